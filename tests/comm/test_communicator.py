"""The communicator on real ranks: splits, zero-copy buffers, collectives, the watchdog."""

import math
import os
import threading
import time

import pytest
import torch
from mpi4py import MPI

from mpisolve.comm import communicator
from mpisolve.comm.communicator import Communicator, mpi_buffer
from mpisolve.errors import CommTimeout


@pytest.mark.mpi(min_size=2)
def test_ranks_and_node_split():
    comm = Communicator()
    assert (comm.rank, comm.size) == (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
    assert comm.local_size == comm.size and comm.local_rank == comm.rank  # one machine
    assert comm.nodes == 1
    assert comm.host_size == comm.size
    auto = Communicator(wait="auto")
    assert auto.wait_policy == ("yield" if comm.size > comm.cores else "spin")
    auto.free()


@pytest.mark.mpi(min_size=2)
def test_buffers_are_zero_copy():
    t = torch.arange(6, dtype=torch.float32).view(2, 3)
    arr, _ = mpi_buffer(t)
    assert arr.ctypes.data == t.data_ptr()
    half = torch.ones(4, dtype=torch.bfloat16)
    arr, dtype = mpi_buffer(half)
    assert dtype == MPI.BYTE and arr.nbytes == 8 and arr.ctypes.data == half.data_ptr()


@pytest.mark.mpi(min_size=2)
def test_inplace_allreduce_and_bcast():
    comm = Communicator()
    t = torch.full((5,), float(comm.rank + 1), dtype=torch.float64)
    comm.allreduce_(t)
    assert t.tolist() == [comm.size * (comm.size + 1) / 2] * 5
    b = torch.full((3,), float(comm.rank), dtype=torch.bfloat16)
    comm.bcast_(b, root=1)
    assert b.tolist() == [1.0] * 3


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("given", [math.inf, math.nan, -1.0, 0.0])
def test_a_timeout_that_is_no_finite_positive_number_is_refused_on_every_rank(given):
    with pytest.raises(ValueError, match="timeout_s must be a finite number of seconds > 0"):
        Communicator(timeout_s=given)


@pytest.mark.mpi(min_size=2)
def test_a_bad_mpisolve_timeout_is_named(monkeypatch):
    monkeypatch.setenv("MPISOLVE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="MPISOLVE_TIMEOUT must be a number of seconds, got 'soon'"):
        Communicator()
    monkeypatch.setenv("MPISOLVE_TIMEOUT", "inf")
    with pytest.raises(ValueError, match="MPISOLVE_TIMEOUT must be a finite number of seconds > 0"):
        Communicator()
    Communicator(timeout_s=5.0)  # an explicit timeout wins over the environment; the ranks still agree


@pytest.mark.mpi(min_size=2)
def test_watchdog_names_the_operation_instead_of_hanging():
    comm = Communicator(timeout_s=0.5)
    if comm.rank == 0:
        request = comm.comm.Ibarrier()
        with pytest.raises(CommTimeout, match="test barrier did not complete within 0.5 s on rank 0"):
            comm.wait(request, "test barrier")
        comm.timeout_s = 30
        comm.wait(request, "test barrier, second try")  # the late ranks join: it completes
        assert comm.blocked_s >= 0.5
    else:
        time.sleep(2.0)
        comm.barrier()


@pytest.mark.mpi(min_size=2)
def test_persistent_allreduce_reused():
    comm = Communicator()
    t = torch.zeros(7)
    req = comm.persistent_allreduce(t)
    for i in range(3):
        t.fill_(comm.rank + i)
        req.start()
        req.wait()
        assert t.tolist() == [sum(range(comm.size)) + i * comm.size] * 7
    req.free()


@pytest.mark.mpi(min_size=2)
def test_persistent_bcast_reused_from_any_root():
    comm = Communicator()
    t = torch.zeros(5, dtype=torch.float64)
    root = comm.size - 1
    req = comm.persistent_bcast(t, root)
    for i in range(3):
        t.fill_(float(comm.rank * 10 + i))
        req.start()
        req.wait()
        assert t.tolist() == [float(root * 10 + i)] * 5
    req.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)
def test_a_persistent_collective_in_flight_is_not_freed():
    """Freeing an active request is erroneous in MPI: refused until it has completed."""
    comm = Communicator()
    signal = comm.dup()  # rank 1 starts only once rank 0 has tried to free
    buf = torch.ones(4)
    allreduce = comm.persistent_allreduce(buf)
    if comm.rank == 0:
        allreduce.start()
        with pytest.raises(RuntimeError, match="freed while still in flight"):
            allreduce.free()
        signal.barrier()
    else:
        signal.barrier()
        allreduce.start()
    allreduce.wait()
    allreduce.free()
    assert buf.tolist() == [2.0] * 4
    signal.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_the_first_communicator_gives_torch_its_share_of_the_cores(monkeypatch):
    """Made directly, not through mpisolve.init(): before the fix each rank kept torch's default
    (every core), so ranks sharing a machine oversubscribed it where torchrun gives each one thread."""
    before = torch.get_num_threads()
    try:
        for omp in (None, "3"):
            monkeypatch.setattr(communicator, "_threads_chosen", False)  # as in a fresh process
            if omp is None:
                monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
            else:
                monkeypatch.setenv("OMP_NUM_THREADS", omp)
            torch.set_num_threads(7)
            comm = Communicator()
            want = max(1, comm.cores // comm.host_size) if omp is None else 7  # OMP_NUM_THREADS: the user's
            assert torch.get_num_threads() == want
            Communicator()  # later ones leave it be
            assert torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)


@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_ranks_share_cores_when_they_outnumber_the_cores_they_may_use_together():
    """Ranks bound one to a core do not share when there are cores enough; bound or not, more ranks than cores do."""
    cpus = sorted(os.sched_getaffinity(0))
    free = Communicator(MPI.COMM_WORLD.Dup())
    assert not free.pinned and free.host_cores == len(cpus)
    assert free.shares_cores == free.shares_cores_evenly == (free.host_size > len(cpus))
    free.free()
    os.sched_setaffinity(0, {cpus[free.rank % len(cpus)]})
    try:
        bound = Communicator(MPI.COMM_WORLD.Dup())
    finally:
        os.sched_setaffinity(0, set(cpus))
    assert bound.cores == 1 and bound.host_cores == min(len(cpus), bound.host_size)
    assert bound.pinned == (len(cpus) > 1)
    assert bound.shares_cores == (bound.host_size > len(cpus))
    if "MPISOLVE_WAIT" not in os.environ:
        assert bound.wait_policy == ("yield" if bound.shares_cores else "spin")
    assert not bound.shares_cores_evenly or len(cpus) == 1
    bound.free()


@pytest.mark.parametrize("transfers", [False, True])
def test_a_long_yielding_wait_sleeps_unless_it_moves_transfers_between_nodes(transfers, monkeypatch):
    """MPI moves a large message between nodes only while a rank calls into it: such a wait
    never sleeps between polls, where any other long wait of the yield policy does."""
    comm = Communicator(wait="yield")
    waiting, slept, real = threading.current_thread(), [], time.sleep

    class Clock:  # the communicator module's time, its sleeps on this thread recorded (not taken)
        perf_counter = staticmethod(time.perf_counter)

        @staticmethod
        def sleep(seconds: float) -> None:
            if threading.current_thread() is waiting:
                slept.append(seconds)
            else:
                real(seconds)

    monkeypatch.setattr(communicator, "time", Clock)
    end = time.perf_counter() + 3 * communicator.YIELD_BEFORE_SLEEP_S
    comm.wait_for(lambda: time.perf_counter() > end, "a long wait", transfers=transfers)
    assert bool(slept) != transfers
