"""The engines behind the reusable collectives: the choice every rank agrees on, and gloo's (and,
on a GPU, NCCL's) collectives against numpy, through the one protocol (start, test, wait, free)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from mpisolve.comm.communicator import Communicator, PersistentAllreduce
from mpisolve.comm.engine import ENGINE_ENV, TorchCollective, TorchMessage, resolve_engine
from mpisolve.comm.readback import host_reads
from mpisolve.comm.reusable import reusable_allreduce, reusable_bcast, reusable_sum
from mpisolve.errors import CommTimeout


def facts(choice, *gpus, nccl=True, machine="m"):
    return [(choice, "test", machine, gpu, nccl) for gpu in gpus]


def test_auto_picks_nccl_only_where_every_rank_owns_a_gpu():
    assert resolve_engine(facts("auto", 0, 1))[0] == "nccl"
    assert resolve_engine(facts("auto", 0, 0)) == (
        "mpi",
        "auto: ranks share a GPU (NCCL refuses two ranks on one device)",
    )
    assert resolve_engine(facts("auto", 0, None))[0] == "mpi"
    assert resolve_engine(facts("auto", 0, 1, nccl=False))[0] == "mpi"
    two_machines = [("auto", "test", "a", 0, True), ("auto", "test", "b", 0, True)]
    assert resolve_engine(two_machines)[0] == "nccl"
    assert resolve_engine(facts("gloo", None, None))[0] == "gloo"
    assert resolve_engine(facts("mpi", 0, 1))[0] == "mpi"


def test_an_engine_that_cannot_run_or_that_ranks_disagree_on_is_refused_by_name():
    with pytest.raises(ValueError, match="cannot run here: ranks share a GPU"):
        resolve_engine(facts("nccl", 0, 0))
    with pytest.raises(ValueError, match="torch was built without NCCL"):
        resolve_engine(facts("nccl", 0, 1, nccl=False))
    with pytest.raises(ValueError, match="rank 0: gloo, rank 1: mpi"):
        resolve_engine([*facts("gloo", None), *facts("mpi", None)])
    with pytest.raises(ValueError, match="engine must be one of .* got 'ncl' on rank 1"):
        resolve_engine([*facts("mpi", None), *facts("ncl", None)])


def test_mpi_is_the_engine_without_a_gpu_and_gloo_when_asked():
    assert Communicator().engine == "mpi"
    comm = Communicator(engine="gloo")
    assert comm.engine == "gloo" and comm.dup().engine == "gloo"
    t = torch.ones(3)
    assert isinstance(reusable_sum(Communicator(), t), PersistentAllreduce)
    assert isinstance(reusable_sum(comm, t), TorchCollective)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_gloo_runs_the_reusable_collectives_as_numpy_says():
    comm = Communicator(engine="gloo")
    n, rank = comm.size, comm.rank
    values = torch.arange(7, dtype=torch.float32) * (rank + 1)
    total = reusable_sum(comm, values)
    largest = reusable_allreduce(comm, torch.zeros(4, dtype=torch.int64), "max")
    shared = reusable_bcast(comm, torch.zeros(5, dtype=torch.float64), root=n - 1)
    for round_ in range(3):  # reused: the same objects, new values each round
        values.copy_(torch.arange(7, dtype=torch.float32) * (rank + 1 + round_))
        largest.tensor.copy_(torch.tensor([rank, -rank, round_, 10 * rank]))
        shared.tensor.fill_(float(rank + round_))
        for op in (total, largest, shared):
            op.start()
        for op in (total, largest, shared):
            op.wait("test")
            assert op.test()
        expected = sum(np.arange(7) * (r + 1 + round_) for r in range(n))
        np.testing.assert_array_equal(values.numpy(), expected)
        np.testing.assert_array_equal(largest.tensor.numpy(), [n - 1, 0, round_, 10 * (n - 1)])
        np.testing.assert_array_equal(shared.tensor.numpy(), np.full(5, n - 1 + round_))
    for op in (total, largest, shared):
        op.free()
    comm.free()


def p2p_waiters():
    return {t for t in threading.enumerate() if t.name == "mpisolve-gloo-p2p"}


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4)
def test_gloo_messages_around_a_ring_arrive_as_sent_through_one_waiter():
    """Reused sends and receives to both neighbours, several rounds: numpy's values, and one waiter thread for them
    all (none per message), gone once the communicator is freed."""
    comm = Communicator(engine="gloo")
    n, rank = comm.size, comm.rank
    right, left = (rank + 1) % n, (rank - 1) % n
    group = comm.torch_group()
    before = p2p_waiters()
    out = [torch.zeros(6, dtype=torch.float64) for _ in range(2)]
    got = [torch.zeros(6, dtype=torch.float64) for _ in range(2)]
    messages = [
        TorchMessage(group, out[0], right, 1, comm.wait_for, receive=False),
        TorchMessage(group, out[1], left, 2, comm.wait_for, receive=False),
        TorchMessage(group, got[0], left, 1, comm.wait_for, receive=True),
        TorchMessage(group, got[1], right, 2, comm.wait_for, receive=True),
    ]
    for round_ in range(5):
        out[0].copy_(torch.arange(6) + 10 * rank + round_)
        out[1].copy_(-(torch.arange(6) + 10 * rank + round_))
        for message in reversed(messages) if rank % 2 else messages:  # posted in different orders
            message.start()
        for message in messages:
            message.wait("ring test")
            assert message.test()
        np.testing.assert_array_equal(got[0].numpy(), np.arange(6) + 10 * left + round_)
        np.testing.assert_array_equal(got[1].numpy(), -(np.arange(6) + 10 * right + round_))
    (waiter,) = p2p_waiters() - before  # the group's one, started by its first message and kept
    for message in messages:
        message.free()
    comm.free()
    waiter.join(timeout=10)
    assert not waiter.is_alive()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_a_gloo_receive_whose_sender_never_sends_ends_in_the_watchdog():
    """The last rank never sends: rank 0's wait for that message ends in a CommTimeout (the waiter thread's gloo
    wait fails in turn: gloo closes the pair), no hang; every rank then frees the communicator."""
    world = Communicator()
    comm = Communicator(engine="gloo", timeout_s=2.0)
    group = comm.torch_group()
    if comm.rank == 0:
        lost = TorchMessage(group, torch.zeros(3), comm.size - 1, 7, comm.wait_for, receive=True)
        lost.start()
        with pytest.raises(CommTimeout, match="a receive nobody sends did not complete within 2 s"):
            lost.wait("a receive nobody sends")
    world.barrier()  # the other ranks wait here, on a communicator with the default watchdog
    comm.free()
    world.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)
def test_ranks_asking_for_different_engines_all_get_the_error(monkeypatch):
    from mpi4py import MPI

    monkeypatch.setenv(ENGINE_ENV, "gloo" if MPI.COMM_WORLD.Get_rank() == 0 else "mpi")
    with pytest.raises(ValueError, match="the ranks asked for different engines"):
        Communicator()


@pytest.mark.gpu
def test_nccl_at_one_rank_sums_a_device_tensor_and_the_host_never_waits():
    if not torch.distributed.is_nccl_available():
        pytest.skip("torch without NCCL")
    comm = Communicator(engine="nccl")
    t = torch.arange(1 << 20, dtype=torch.float32, device=comm.device)
    total = reusable_sum(comm, t)
    assert isinstance(total, TorchCollective)
    expected = t.clone()
    total.start()  # the first makes NCCL's communicator, which may synchronize: not checked
    total.wait("nccl test")
    torch.testing.assert_close(t, expected)
    reads = host_reads()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            total.start()
            total.wait("nccl test")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert host_reads() == reads
    torch.testing.assert_close(t, expected)
    total.free()
    comm.free()


@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)
def test_gloo_sums_cuda_tensors_of_ranks_sharing_a_gpu():
    comm = Communicator(engine="gloo")
    t = torch.full((1000,), float(comm.rank + 1), device=comm.device)
    total = reusable_sum(comm, t)
    total.start()
    total.wait("gloo cuda test")
    assert torch.equal(t.cpu(), torch.full((1000,), float(sum(range(1, comm.size + 1)))))
    total.free()
    comm.free()


def test_the_engine_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENGINE_ENV, "gloo")
    assert Communicator().engine == "gloo"
    monkeypatch.setenv(ENGINE_ENV, "nope")
    with pytest.raises(ValueError, match="got 'nope' on rank 0"):
        Communicator()
    assert os.environ[ENGINE_ENV] == "nope"
