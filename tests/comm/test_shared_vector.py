"""SharedVector: exact concurrent accumulates on both paths, locked updates, progress, clean close."""

import os
import threading
import time

import pytest
import torch

from mpisolve.comm.communicator import Communicator
from mpisolve.comm.windows import SharedVector

N = 5000  # 20 kB of float32: with 4 kB chunks every accumulate is several RMA operations per shard


def contribution(rank, n=N):
    """Integer-valued floats, different on every rank: sums are exact in float32."""
    return (torch.arange(n) % 7 + rank + 1).float()


def expected_sum(size, rounds, n=N):
    return rounds * sum(contribution(r, n) for r in range(size))


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4)
@pytest.mark.parametrize("layout", ["sharded", "server"])
@pytest.mark.parametrize("force_internode", [False, True])
def test_concurrent_accumulates_lose_no_update(force_internode, layout):
    comm = Communicator()
    rounds = 40
    with SharedVector(comm, N, torch.float32, layout=layout, force_internode=force_internode, chunk_bytes=4096) as v:
        assert v.path == ("internode" if force_internode else "shared")
        v.store_(torch.zeros(N))
        mine, seen = contribution(comm.rank), torch.empty(N)
        for k in range(rounds):
            v.accumulate(mine)
            v.read(seen)
            # a rank's read follows its own accumulates (MPI orders them per location)
            assert bool((seen >= (k + 1) * mine).all())
        v.quiesce()
        v.read(seen)
        assert torch.equal(seen, expected_sum(comm.size, rounds))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["sharded", "server"])
@pytest.mark.parametrize("force_internode", [False, True])
def test_locked_read_modify_write_is_atomic_per_shard(force_internode, layout):
    """Under the exclusive lock a plain (non-atomic) add in the update function loses nothing."""
    comm = Communicator()
    rounds = 25
    with SharedVector(
        comm, N, torch.float32, layout=layout, locked=True, force_internode=force_internode, chunk_bytes=4096
    ) as v:
        v.store_(torch.zeros(N))
        mine = contribution(comm.rank)
        for _ in range(rounds):
            v.update(lambda center, start, stop: center.add_(mine[start:stop]))
        v.quiesce()
        seen = torch.empty(N)
        v.read(seen)
        assert torch.equal(seen, expected_sum(comm.size, rounds))


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 4)
@pytest.mark.parametrize("locked", [False, True])
def test_updates_complete_while_the_owner_stays_out_of_mpi(locked):
    """Rank 0 owns everything and sleeps outside MPI while the others update; the progress thread serves them."""
    comm = Communicator()
    with SharedVector(comm, N, torch.float64, layout="server", locked=locked, force_internode=True) as v:
        v.store_(torch.zeros(N, dtype=torch.float64))
        if comm.rank == 0:
            time.sleep(0.5)
        else:
            mine = contribution(comm.rank).double()
            for _ in range(10):
                v.update(lambda center, start, stop: center.add_(mine[start:stop]))
        v.quiesce()
        seen = torch.empty(N, dtype=torch.float64)
        v.read(seen)
        assert torch.equal(seen, 10 * sum(contribution(r).double() for r in range(1, comm.size)))


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 4)
def test_locked_shared_memory_updates_complete_while_the_owner_stays_out_of_mpi():
    """The shared path's locks are granted without their owner.

    Rank 0 owns the vector and, outside MPI, waits to see the others' locked updates
    land in its memory: node-shared locks need nobody's progress engine (MPI's
    ``Win_lock`` needed the owner's, and a progress thread).
    """
    comm = Communicator()
    rounds = 5
    total = rounds * sum(contribution(r).double() for r in range(1, comm.size))
    with SharedVector(comm, N, torch.float64, layout="server", locked=True) as v:
        assert v.path == "shared"
        v.store_(torch.zeros(N, dtype=torch.float64))
        if comm.rank == 0:
            deadline = time.monotonic() + 20.0  # a lock never granted: fail, not hang
            while not torch.equal(v.view, total) and time.monotonic() < deadline:
                time.sleep(1e-3)
            assert torch.equal(v.view, total), "the locked updates did not land while the owner stayed out of MPI"
        else:
            mine = contribution(comm.rank).double()
            for _ in range(rounds):
                v.update(lambda center, start, stop: center.add_(mine[start:stop]))
        v.quiesce()


def progress_threads():
    return [t for t in threading.enumerate() if t.name == "mpisolve-rma-progress"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("locked", [False, True])
@pytest.mark.parametrize("force_internode", [False, True])
def test_close_frees_the_window_and_stops_the_progress_thread(force_internode, locked):
    comm = Communicator()
    v = SharedVector(comm, 100, torch.float32, force_internode=force_internode, locked=locked)
    assert len(progress_threads()) == (1 if force_internode else 0)  # the shared path needs none, locked or not
    v.accumulate(torch.ones(100))
    v.close()
    v.close()  # idempotent
    assert v.closed and not v.win and not progress_threads()
    with pytest.raises(RuntimeError, match="closed"):
        v.read(torch.empty(100))


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)
@pytest.mark.parametrize("force_internode", [False, True])
def test_time_waiting_for_a_window_lock_counts_as_blocked(force_internode):
    """Rank 1 holds its shard's exclusive lock for 0.5 s; rank 0's read waits for it, in MPI."""
    comm = Communicator()
    hold_s = 0.5
    with SharedVector(comm, N, torch.float32, locked=True, force_internode=force_internode) as v:
        if comm.rank == 1:

            def hold(center, start, stop):
                if start == v.bounds[1][0]:  # rank 1's own shard, locked first
                    comm.barrier("holding")
                    time.sleep(hold_s)

            v.update(hold)
        else:
            comm.barrier("holding")
            before, start = comm.blocked_s, time.perf_counter()
            v.read(torch.empty(N))
            waited = time.perf_counter() - start
            assert waited >= hold_s / 2  # the lock really was held across the read
            assert comm.blocked_s - before >= 0.9 * waited  # ... and the wait counts as blocked in MPI


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4)
@pytest.mark.parametrize("layout", ["sharded", "server"])
def test_node_shared_locks_exclude_writers_under_contention(layout):
    """Every rank bumps every element by a read, a yield of the core and a write: a lost update shows a broken lock."""
    comm = Communicator()
    rounds, n = 150, 64
    with SharedVector(comm, n, torch.float64, layout=layout, locked=True) as v:
        assert v.path == "shared" and not progress_threads()
        v.store_(torch.zeros(n, dtype=torch.float64))

        def bump(center, start, stop):
            seen = center.clone()
            os.sched_yield()  # let another rank in, if the lock would
            center.copy_(seen + 1)

        for _ in range(rounds):
            v.update(bump)
        v.quiesce()
        out = torch.empty(n, dtype=torch.float64)
        v.read(out)
        assert torch.equal(out, torch.full((n,), float(rounds * comm.size), dtype=torch.float64))


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4)
def test_readers_of_node_shared_locks_never_see_a_half_written_shard():
    """Rank 0 writes each shard in two halves with a pause between; every read finds each shard uniform."""
    comm = Communicator()
    rounds, n = 100, 4096
    torn: list[str] = []
    out = torch.empty(n, dtype=torch.float64)
    with SharedVector(comm, n, torch.float64, locked=True) as v:
        v.store_(torch.zeros(n, dtype=torch.float64))
        if comm.rank == 0:
            for k in range(1, rounds + 1):

                def write(center, start, stop, k=k):
                    half = (stop - start) // 2
                    center[:half].fill_(k)
                    time.sleep(2e-3)
                    center[half:].fill_(k)

                v.update(write)
        else:
            deadline = time.monotonic() + 60.0  # the writer never done: fail, not hang
            while not torn and time.monotonic() < deadline:
                v.read(out)
                torn += [f"{lo}:{hi}" for lo, hi in v.bounds if not bool((out[lo:hi] == out[lo]).all())]
                if bool((out == rounds).all()):
                    break
        v.quiesce()  # a reader that saw a torn shard stops reading; the collective calls still match
        v.read(out)
    assert not torn, f"shards {torn} read half written"
    assert bool((out == rounds).all())
