"""Every registered solver's training step, one after another in one process.

``python -m mpi4py -m perf.gpu.every_solver [bench step options]``, from the repository
root (under ``mpiexec -n N`` for N ranks), runs ``mpisolve bench step --solver NAME`` for
each registered solver; rank 0 prints each one's JSON line. A solver that every rank
refuses alike (an input error) is listed as failed and the next one runs; an exception
ends the job (``python -m mpi4py`` aborts it), since the other ranks may be waiting in
a collective. ``perf/gpu/check.sh`` runs it on one GPU at one rank and with two ranks
sharing it.
"""

from __future__ import annotations

import json
import sys

import mpisolve
from mpisolve.cli import main


def run_all(extra: list[str]) -> int:
    failed = [name for name in mpisolve.solver_names() if main(["bench", "step", "--solver", name, *extra]) != 0]
    print(json.dumps({"failed": failed}), file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_all(sys.argv[1:]))
