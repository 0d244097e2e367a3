"""An uncaught exception on one rank ends the job, and its error's own line comes before the traceback."""

import os
import subprocess
import sys
from pathlib import Path

RAISE_ON_RANK_1 = """
import mpisolve
comm = mpisolve.init()
if comm.rank == 1:
    raise ValueError("boom on purpose")
comm.barrier()  # rank 0 waits here until the abort ends it
"""


def test_an_uncaught_exception_reports_its_line_first_and_ends_the_job():
    """mpiexec may drop what a rank wrote last when the job is torn down: the line must not be last."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = dict(os.environ, MPIEXEC_TIMEOUT="90")
    job = subprocess.run(
        [str(mpiexec), "-n", "2", sys.executable, "-c", RAISE_ON_RANK_1],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert job.returncode != 0, job.stderr
    line = job.stderr.find("ValueError: boom on purpose (rank 1; traceback below)")
    assert 0 <= line < job.stderr.find("Traceback (most recent call last)"), job.stderr
