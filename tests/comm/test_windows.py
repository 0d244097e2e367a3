"""SharedVector on one rank, its shard layout and its option checks; a stalled lock holder ends the job."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mpisolve.comm.communicator import Communicator
from mpisolve.comm.windows import SharedVector, shard_bounds
from mpisolve.errors import OptionError


@pytest.mark.parametrize("numel", [1, 15, 16, 1000, 1001])
@pytest.mark.parametrize("size", [1, 3, 4, 8])
def test_sharded_bounds_tile_the_vector_on_cache_lines(numel, size):
    bounds = shard_bounds(numel, size, "sharded", itemsize=4)
    assert len(bounds) == size and bounds[0][0] == 0 and bounds[-1][1] == numel
    for (_, stop), (start, _) in zip(bounds, bounds[1:]):
        assert stop == start
    assert all(start % 16 == 0 for start, stop in bounds if stop > start)
    assert max(stop - start for start, stop in bounds) <= -(-numel // size) + 15


def test_server_layout_puts_everything_on_rank_0():
    assert shard_bounds(10, 3, "server", itemsize=8) == [(0, 10), (10, 10), (10, 10)]


@pytest.mark.parametrize("locked", [False, True])
@pytest.mark.parametrize("force_internode", [False, True])
def test_single_rank_operations(locked, force_internode):
    comm = Communicator()
    with SharedVector(comm, 300, torch.float64, locked=locked, force_internode=force_internode, chunk_bytes=512) as v:
        values = torch.arange(300, dtype=torch.float64)
        v.store_(values)
        v.accumulate(torch.ones(300, dtype=torch.float64))
        v.update(lambda center, start, stop: center.mul_(2))
        out = torch.empty(300, dtype=torch.float64)
        v.read(out)
        assert torch.equal(out, 2 * (values + 1))


def test_bad_arguments_are_refused():
    comm = Communicator()
    with pytest.raises(OptionError, match="layout"):
        SharedVector(comm, 10, torch.float32, layout="ring")
    with pytest.raises(TypeError, match="float32 or float64"):
        SharedVector(comm, 10, torch.float16)


STALL_IN_LOCK = """
import sys, time, torch
from mpisolve.comm.communicator import Communicator
from mpisolve.comm.windows import SharedVector

comm = Communicator(timeout_s=float(sys.argv[1]))
v = SharedVector(comm, 1000, torch.float32, locked=True, force_internode=sys.argv[2] == "internode")
if comm.rank == 1:
    def stall(center, start, stop):  # holding the exclusive lock on its own shard
        comm.barrier()
        time.sleep(3600)

    v.update(stall)
comm.barrier()
print(f"reading at {time.time()}", file=sys.stderr, flush=True)
if sys.argv[3] == "read":
    v.read(torch.empty(1000))  # waits for rank 1's lock
else:
    v.update(lambda center, start, stop: None)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "op", "wait"),
    [
        ("shared", "read", "taking the shared lock on rank 1's shard of a shared vector (node-shared)"),
        ("shared", "update", "taking the exclusive lock on rank 1's shard of a shared vector (node-shared)"),
        ("internode", "read", "MPI_Win_lock (target rank 1)"),
    ],
)
def test_a_rank_stalled_in_a_window_lock_ends_the_job(path, op, wait):
    """The watchdog ends a wait for a lock another rank holds: a node-shared lock's polled wait raises,
    a blocking ``Win_lock`` (which cannot be polled) is caught by the watchdog thread; the job aborts."""
    bin_dir = Path(sys.executable).parent
    cmd = [str(bin_dir / "mpiexec"), "-n", "2", sys.executable, "-m", "mpi4py", "-c", STALL_IN_LOCK, "2", path, op]
    env = dict(os.environ, MPIEXEC_TIMEOUT="90")
    job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    ended = time.time()
    assert job.returncode != 0, job.stderr
    assert f"CommTimeout: mpisolve: {wait} did not complete within 2 s on rank 0 of 2" in job.stderr
    reading_at = float(next(line for line in job.stderr.splitlines() if line.startswith("reading at")).split()[-1])
    print(f"{path}: exit {job.returncode}, ended {ended - reading_at:.1f} s after the wait began")
    assert ended - reading_at < 30  # the bound for a failing rank
