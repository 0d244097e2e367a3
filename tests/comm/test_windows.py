"""SharedVector on one rank, its shard layout and its option checks."""

import pytest
import torch

from mpisolve.comm.communicator import Communicator
from mpisolve.comm.windows import SharedVector, check_progress, shard_bounds
from mpisolve.options import OptionError


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


def test_progress_modes_are_checked(monkeypatch):
    with pytest.raises(OptionError, match="progress must be one of"):
        check_progress("fast")
    monkeypatch.delenv("MPICH_ASYNC_PROGRESS", raising=False)
    with pytest.raises(OptionError, match="MPICH_ASYNC_PROGRESS=1"):
        check_progress("mpich")
    check_progress("thread")


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
