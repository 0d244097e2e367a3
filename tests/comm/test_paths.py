"""Sums picked by size: below the crossover flat MPI, above it node-shared memory; one tensor's fast path.

Every rank must take the same path for a sum of the same bytes, whatever crossover it asks
for (``MPISOLVE_NODE_SHM_MIN_BYTES`` differing between ranks: the largest is agreed), and the
sums are exact on both sides of the crossover (integers in float32, numpy's sum as the
oracle). ``mpisolve.allreduce`` of one CPU tensor (:mod:`mpisolve.comm.onetensor`) gives what
the general path gives, and ranks whose tensors differ get :class:`TensorMismatchError` on
every rank, with nothing left hanging: the next call works. Also run on the emulated 2-node
cluster (``make test-cluster``), where the layout's own crossover applies.
"""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpisolve
from mpisolve.comm import onetensor, shm
from mpisolve.comm.buckets import GradientBuckets
from mpisolve.comm.closing import CloseNotices
from mpisolve.comm.collectives import allreduce as general_allreduce
from mpisolve.comm.communicator import Communicator
from mpisolve.comm.reusable import reusable_sum
from mpisolve.errors import PeerClosed

CROSSOVER = 16 * 1024
BELOW, ABOVE = CROSSOVER // 4 - 8, CROSSOVER // 4 + 8  # float32 elements either side of it
SIZES = pytest.mark.ranks(2, 3, 4, 5, 8)


def fresh(monkeypatch: pytest.MonkeyPatch, min_bytes: str | None) -> Communicator:
    """A communicator of every rank whose node group reads ``min_bytes`` (None: the layout's default)."""
    if min_bytes is None:
        monkeypatch.delenv(shm.MIN_BYTES_ENV, raising=False)
    else:
        monkeypatch.setenv(shm.MIN_BYTES_ENV, min_bytes)
    return Communicator(MPI.COMM_WORLD.Dup())


def inputs(comm: Communicator, numel: int, round_: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """This rank's input (small integers: every sum order is exact) and numpy's sum over the ranks."""

    def of(rank: int) -> np.ndarray:
        return np.random.default_rng(100 * round_ + rank).integers(-50, 50, numel).astype(np.float32)

    total = np.sum([of(r) for r in range(comm.size)], axis=0, dtype=np.float32)
    return torch.from_numpy(of(comm.rank)), total


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@SIZES
def test_ranks_asking_for_different_crossovers_agree_on_the_largest_and_take_one_path(monkeypatch):
    asked = CROSSOVER // 2 * (1 + MPI.COMM_WORLD.Get_rank() % 2)  # two crossovers among the ranks
    comm = fresh(monkeypatch, str(asked))
    group = shm.node_group(comm)
    if group is None:  # one rank per node: every sum is MPI's
        pytest.skip("node-shared sums do not apply to this layout")
    assert group.min_bytes == group.one_shot_min_bytes == CROSSOVER
    for numel in (BELOW, ABOVE):
        tensor, total = inputs(comm, numel)
        buffer = tensor.clone()
        op = reusable_sum(comm, buffer)
        kinds = comm.comm.allgather(type(op).__name__)
        assert len(set(kinds)) == 1, kinds
        assert (kinds[0] == "NodePersistentAllreduce") == (numel * 4 >= CROSSOVER)
        for _ in range(2):
            buffer.copy_(tensor)  # the sum is in place: the input again for the next round
            op.start()
            op.wait()
            np.testing.assert_array_equal(buffer.numpy(), total)
        op.free()
    comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@SIZES
@pytest.mark.parametrize("numel", [BELOW, ABOVE])
def test_gradient_buckets_sum_exactly_on_either_side_of_the_crossover(numel, monkeypatch):
    comm = fresh(monkeypatch, str(CROSSOVER))
    grad, total = inputs(comm, numel)
    param = torch.nn.Parameter(torch.zeros(numel))
    grads = GradientBuckets([param], comm, bucket_bytes=10**6, average=False)
    on_node = grads.node is not None
    assert len(set(comm.comm.allgather(on_node))) == 1
    assert on_node == (shm.node_group(comm) is not None and numel * 4 >= CROSSOVER)
    for _ in range(2):
        grads.rearm()
        assert param.grad is not None
        param.grad.copy_(grad)
        grads.finish()
        np.testing.assert_array_equal(param.grad.numpy(), total)
    grads.close()
    comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@SIZES
@pytest.mark.parametrize("min_bytes", [str(CROSSOVER), None])
def test_one_tensor_sums_match_numpy_and_the_general_path_on_every_size(min_bytes, monkeypatch):
    """From the one-shot crossover (by default every size) one tensor goes in one node-shared round
    where node-shared sums apply; below it, and where they do not, in one MPI message."""
    comm = fresh(monkeypatch, min_bytes)
    one = onetensor.one_tensor(comm)
    node_from = 0 if min_bytes is None else CROSSOVER
    sizes = [1, BELOW, ABOVE, 100_000, 300_000]
    for round_, numel in enumerate(sizes * 2):  # twice: each signature agreed, then from its agreement
        tensor, total = inputs(comm, numel, round_)
        shaped = tensor.view(1, numel) if round_ % 2 else tensor
        summed = mpisolve.allreduce(shaped, op="sum", comm=comm)
        assert summed.shape == shaped.shape and summed.dtype == torch.float32
        np.testing.assert_array_equal(summed.reshape(-1).numpy(), total)
        node = one.group is not None and 4 * numel >= node_from
        assert one.agreed is not None and one.agreed[1] == (onetensor.NODE if node else onetensor.INLINE)
        averaged = mpisolve.allreduce(shaped, op="average", comm=comm)
        (general,) = general_allreduce([shaped], op="average", comm=comm)
        torch.testing.assert_close(averaged, general)  # same division of the same exact sum
        torch.testing.assert_close(averaged.reshape(-1), torch.from_numpy(total / comm.size))
    double = torch.arange(5, dtype=torch.float64, requires_grad=True)
    twice = mpisolve.allreduce(double, op="sum", comm=comm)
    assert twice.dtype == torch.float64 and not twice.requires_grad
    torch.testing.assert_close(twice, torch.arange(5, dtype=torch.float64) * comm.size)
    half = mpisolve.allreduce(torch.ones(3, dtype=torch.bfloat16), op="sum", comm=comm)  # the general path
    assert half.dtype == torch.bfloat16 and half.tolist() == [comm.size] * 3
    comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@SIZES
def test_one_tensor_mismatches_raise_on_every_rank_and_the_next_call_works(monkeypatch):
    comm = fresh(monkeypatch, str(CROSSOVER))
    rank = comm.rank
    ones = torch.ones(BELOW)
    big = torch.ones(100_000)
    cases = [
        lambda: torch.ones(BELOW + rank),  # elements (none agreed yet)
        lambda: torch.ones(BELOW + rank),  # again (the inline signature agreed since)
        lambda: torch.ones(BELOW).view(2, -1) if rank else ones,  # shape, same elements
        lambda: torch.ones(BELOW, dtype=torch.float64 if rank else torch.float32),  # dtype
        lambda: torch.ones(10**6 + rank),  # past the crossover: the general path's signature
        lambda: torch.ones(big.numel() + rank),  # past the crossover too
        lambda: ones if rank else torch.ones(10**6),  # one rank on the fast path, another past it
    ]
    agreements = [ones, ones, ones, ones, torch.ones(10**6), big, ones]
    for case, agreed in zip(cases, agreements):
        mpisolve.allreduce(agreed, op="sum", comm=comm)  # the signature every rank agrees on first
        with pytest.raises(mpisolve.TensorMismatchError, match="differ: rank 0 has"):
            mpisolve.allreduce(case(), op="sum", comm=comm)
        assert mpisolve.allreduce(agreed, op="sum", comm=comm).eq(comm.size).all()
    with pytest.raises(mpisolve.TensorMismatchError, match=r"\(sum\)"):  # reductions
        mpisolve.allreduce(ones, op="sum" if rank else "average", comm=comm)
    # Alike signatures, but one rank's tensor is not contiguous: every rank takes the general path.
    strided = torch.ones(2 * BELOW)[::2] if rank == 0 else ones
    assert mpisolve.allreduce(strided, op="sum", comm=comm).eq(comm.size).all()
    assert onetensor.one_tensor(comm).agreed == ((torch.float32, (BELOW,), "sum", 1.0, 1.0), onetensor.GENERAL, BELOW)
    assert mpisolve.allreduce(ones, op="sum", comm=comm).eq(comm.size).all()
    comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@SIZES
@pytest.mark.parametrize("inline_max_bytes", [None, 64 * 1024], ids=["default", "inline-to-64KiB"])
def test_one_tensor_below_the_one_shot_crossover_goes_with_its_check_in_one_message(monkeypatch, inline_max_bytes):
    """Below the one-shot crossover a tensor past 64 KiB goes inline too (its values and the flag in one
    start of the agreed persistent allreduce), or, told to go inline only up to 64 KiB, after the flag's
    own allreduce; either way the sums are numpy's, the input is untouched, and a rank with another shape
    raises on every rank, the next call working."""
    comm = fresh(monkeypatch, str(1 << 20))
    one = onetensor.one_tensor(comm)
    if inline_max_bytes is not None:
        one.inline_max_bytes = inline_max_bytes
    numel = 100_000  # 400 KB: past 64 KiB, below the crossover
    tensor, total = inputs(comm, numel)
    before = tensor.clone()
    mode = onetensor.INLINE if inline_max_bytes is None else onetensor.SEPARATE
    for _ in range(3):
        np.testing.assert_array_equal(mpisolve.allreduce(tensor, op="sum", comm=comm).numpy(), total)
        assert one.agreed == ((torch.float32, (numel,), "sum", 1.0, 1.0), mode, numel)
        inline = isinstance(one.message, onetensor.InlineMessage) and one.message.numel == numel
        assert inline == (mode == onetensor.INLINE)
    scaled = mpisolve.allreduce(tensor.view(100, -1), op="average", comm=comm)
    torch.testing.assert_close(scaled.reshape(-1), torch.from_numpy(total / comm.size))
    assert torch.equal(tensor, before)
    odd = torch.ones(numel + (comm.rank == comm.size - 1))
    with pytest.raises(mpisolve.TensorMismatchError, match=r"differ: rank 0 has float32 \[100000\] \(sum\)"):
        mpisolve.allreduce(odd, op="sum", comm=comm)
    np.testing.assert_array_equal(mpisolve.allreduce(tensor, op="sum", comm=comm).numpy(), total)
    comm.free()


def test_one_tensor_at_one_rank_takes_the_one_call_path_too():
    """A one-rank job's sum or average of one tensor is its own values, in a new tensor, through the
    same one MPI call as at several ranks (not the general path's fusing and polled rounds)."""
    comm = Communicator(MPI.COMM_SELF.Dup())
    tensor = torch.arange(6, dtype=torch.float32).view(2, 3)
    for op in ("sum", "average"):
        result = mpisolve.allreduce(tensor, op=op, comm=comm)
        np.testing.assert_array_equal(result.numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))
        assert result.data_ptr() != tensor.data_ptr()
        assert onetensor.one_tensor(comm).agreed == ((torch.float32, (2, 3), op, 1.0, 1.0), onetensor.INLINE, 6)
    assert torch.equal(tensor, torch.arange(6, dtype=torch.float32).view(2, 3))
    comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_a_communicator_whose_waits_drive_other_work_keeps_the_general_path(monkeypatch):
    """No blocking call there (abs-sgd's round moves only from its ranks' waits): no agreement either."""
    comm = fresh(monkeypatch, str(CROSSOVER))
    comm.interrupts.append(lambda: None)
    tensor, total = inputs(comm, BELOW)
    np.testing.assert_array_equal(mpisolve.allreduce(tensor, op="sum", comm=comm).numpy(), total)
    assert onetensor.one_tensor(comm).agreed is None
    comm.interrupts.clear()
    np.testing.assert_array_equal(mpisolve.allreduce(tensor, op="sum", comm=comm).numpy(), total)
    assert onetensor.one_tensor(comm).agreed == ((torch.float32, (BELOW,), "sum", 1.0, 1.0), onetensor.INLINE, BELOW)
    comm.free()


def watchdog_threads() -> int:
    return sum(t.name == "mpisolve-watchdog" for t in threading.enumerate())


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@SIZES
@pytest.mark.parametrize("wait", ["yield", "spin"])
def test_gradient_buckets_wait_in_mpi_only_where_ranks_yield_and_no_wait_runs_interrupts(wait):
    """Where ranks yield their cores, MPI's path waits in ``MPI_Wait`` under the watchdog thread (the
    fresh communicator's first blocking call starts it), except while waits run interrupts (a
    solver's close notices), which then run between the polls; the sums equal numpy's throughout."""
    comm = Communicator(MPI.COMM_WORLD.Dup(), wait=wait, node_shm=False)
    grad, total = inputs(comm, BELOW)
    param = torch.nn.Parameter(torch.zeros(BELOW))
    grads = GradientBuckets([param], comm, bucket_bytes=10**6, average=False)
    polls: list[int] = []
    comm.interrupts.append(lambda: polls.append(1))
    before = watchdog_threads()

    late_round(comm, grads, param, grad, total)
    assert watchdog_threads() == before  # polled: the interrupts ran instead
    assert comm.comm.allreduce(len(polls)) > 0
    comm.interrupts.clear()
    late_round(comm, grads, param, grad, total)
    assert watchdog_threads() == before + (wait == "yield")
    assert comm.waits_in_mpi() == (wait == "yield")
    grads.close()
    comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@SIZES
@pytest.mark.parametrize("wait", ["yield", "spin"])
def test_a_close_notice_interrupts_a_gradient_bucket_wait_on_mpis_path(wait):
    """A solver's close notices reach a rank waiting in a bucket on MPI's path: with the notices
    registered the sums equal numpy's; then the last rank closes before a round it never enters,
    and every other rank, waiting in that round's bucket, raises :class:`PeerClosed`. Such a wait
    stays polled where ranks yield their cores: MPICH's ``MPI_Waitany`` over the bucket and the
    notices' receives spins there (docs/studies/node-aware.md, 28 Nov 14:00)."""
    comm = Communicator(MPI.COMM_WORLD.Dup(), wait=wait, node_shm=False)
    grad, total = inputs(comm, BELOW)
    param = torch.nn.Parameter(torch.zeros(BELOW))
    grads = GradientBuckets([param], comm, bucket_bytes=10**6, average=False)
    rounds = [0]
    notices = CloseNotices(comm, lambda: rounds[0], "test", "steps")
    late_round(comm, grads, param, grad, total)
    rounds[0] = 1
    last = comm.rank == comm.size - 1
    if last:
        time.sleep(0.2)  # the others wait in round 2 when the notice comes
        table = notices.close(1, entered=False, busy=False)
    else:
        grads.rearm()
        param.grad.copy_(grad)
        with pytest.raises(PeerClosed, match=f"rank {comm.size - 1} reached close\\(\\) after 1 steps"):
            grads.finish()  # its allreduce stays in flight: the request is left allocated, as a solver's
        table = notices.close(1, entered=True, busy=True)
    assert notices.interrupted == (not last)
    assert sorted(table) == list(range(comm.size)) and {c.rounds for c in table.values()} == {1}


def late_round(
    comm: Communicator, grads: GradientBuckets, param: torch.nn.Parameter, grad: torch.Tensor, total: np.ndarray
) -> None:
    """One round of ``grads`` whose rank 0 is late (the others wait for it), its sum checked against ``total``."""
    grads.rearm()
    assert param.grad is not None
    param.grad.copy_(grad)
    if comm.rank == 0:
        time.sleep(0.2)
    grads.finish()
    np.testing.assert_array_equal(param.grad.numpy(), total)


STALL_IN_BUCKET = """
import sys, time
import torch
from mpi4py import MPI
from mpisolve.comm.buckets import GradientBuckets
from mpisolve.comm.communicator import Communicator

comm = Communicator(timeout_s=2, wait="yield", node_shm=False)
param = torch.nn.Parameter(torch.zeros(1000))
grads = GradientBuckets([param], comm, bucket_bytes=10**6)
comm.barrier()
if comm.rank == 1:
    time.sleep(120)  # never reaches the step's allreduce
print(f"waiting at {time.time()}", file=sys.stderr, flush=True)
grads.finish()
"""


@pytest.mark.slow
def test_a_rank_stalled_outside_a_gradient_bucket_waited_in_mpi_ends_the_job():
    """The blocking wait is watched: past the timeout the watchdog names the bucket and aborts the job."""
    bin_dir = Path(sys.executable).parent
    cmd = [str(bin_dir / "mpiexec"), "-n", "2", sys.executable, "-m", "mpi4py", "-c", STALL_IN_BUCKET]
    env = dict(os.environ, MPIEXEC_TIMEOUT="90")
    job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    ended = time.time()
    assert job.returncode != 0, job.stderr
    said = "CommTimeout: mpisolve: gradient allreduce of bucket 0 did not complete within 2 s on rank 0 of 2"
    assert said in job.stderr, job.stderr
    waiting_at = float(next(line for line in job.stderr.splitlines() if line.startswith("waiting at")).split()[-1])
    assert ended - waiting_at < 30  # the bound for a failing rank


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("name", [shm.MIN_BYTES_ENV, shm.KEEP_BYTES_ENV])
@pytest.mark.parametrize("bad", ["-1", "16K", "lots"])
def test_a_byte_setting_that_is_not_a_byte_count_on_one_rank_is_refused_on_every_rank(monkeypatch, name, bad):
    """One rank's bad setting raises on every rank, naming that rank (none is left in a collective), and the
    next communicator with good settings works."""
    last = MPI.COMM_WORLD.Get_size() - 1
    if MPI.COMM_WORLD.Get_rank() == last:
        monkeypatch.setenv(name, bad)
    else:
        monkeypatch.setenv(name, "65536")
    comm = Communicator(MPI.COMM_WORLD.Dup())
    with pytest.raises(ValueError, match=rf"{name} must be a byte count >= 0; rank {last} has '{bad}'"):
        shm.node_group(comm)
    comm.free()
    monkeypatch.setenv(name, "65536")
    comm = Communicator(MPI.COMM_WORLD.Dup())
    group = shm.node_group(comm)
    assert group is None or (group.min_bytes if name == shm.MIN_BYTES_ENV else group.keep_bytes) == 65536
    comm.free()


def capped(monkeypatch: pytest.MonkeyPatch, keep_bytes: int, min_bytes: str | None = None) -> Communicator:
    """:func:`fresh`, its kept node-shared sums holding at most ``keep_bytes`` of windows."""
    monkeypatch.setenv(shm.KEEP_BYTES_ENV, str(keep_bytes))
    return fresh(monkeypatch, min_bytes)


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@SIZES
def test_ranks_asking_for_different_caps_on_kept_windows_agree_on_the_smallest(monkeypatch):
    comm = capped(monkeypatch, 1 << (20 + MPI.COMM_WORLD.Get_rank() % 2))
    group = shm.node_group(comm)
    if group is None:
        pytest.skip("node-shared sums do not apply to this layout")
    assert group.keep_bytes == 1 << 20
    comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@SIZES
def test_one_tensor_whose_window_passes_the_cap_takes_mpi_and_sums_exactly(monkeypatch):
    """A tensor whose node-shared window would pass the cap on kept windows goes through MPI (inline, or
    from where it lies), and one whose window fits through the node-shared round; either is numpy's sum."""
    comm = capped(monkeypatch, 64 * 1024)
    group = shm.node_group(comm)
    if group is None:
        pytest.skip("node-shared sums do not apply to this layout")
    one = onetensor.one_tensor(comm)
    for numel, mode in ((100, onetensor.NODE), (20_000, onetensor.INLINE), (2_000_000, onetensor.SEPARATE)):
        fits = shm.WindowLayout.of(group, numel + 1, torch.float32).total <= group.keep_bytes
        assert fits == (mode == onetensor.NODE)
        tensor, total = inputs(comm, numel)
        for _ in range(2):
            np.testing.assert_array_equal(mpisolve.allreduce(tensor, op="sum", comm=comm).numpy(), total)
            assert one.agreed is not None and one.agreed[1] == mode
        assert one.entries.nbytes <= group.keep_bytes
    comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@SIZES
def test_kept_sums_hold_at_most_the_cap_the_least_recently_asked_for_freed_first(monkeypatch):
    """Windows are kept within the cap, freeing the least recently asked for; a list whose windows pass the
    cap together takes MPI's path and keeps nothing; every sum stays numpy's (node-shared at every size)."""
    comm = fresh(monkeypatch, "0")
    group = shm.node_group(comm)
    if group is None:
        pytest.skip("node-shared sums do not apply to this layout")
    a, b, c = 20_000, 30_000, 10_000  # float32 elements: the bandwidth path's windows, C's the smallest
    window = {n: shm.WindowLayout.of(group, n, torch.float32).total for n in (a, b, c)}
    comm.free()
    comm = capped(monkeypatch, window[a] + window[b], "0")
    group = shm.node_group(comm)
    assert group is not None
    kept = group.kept

    def summed(*numels: int) -> None:
        given = [inputs(comm, n, i) for i, n in enumerate(numels)]
        dtypes = [torch.float32, torch.float64][: len(numels)]  # one buffer per dtype: one sum each
        out = general_allreduce([t.to(d) for (t, _), d in zip(given, dtypes)], op="sum", comm=comm)
        for got, (_, total) in zip(out, given):
            np.testing.assert_array_equal(got.float().numpy(), total)
        assert kept.nbytes <= group.keep_bytes
        assert kept.nbytes == sum(op.nbytes for op in kept.by_key.values())

    summed(a)
    summed(b)
    assert list(kept.by_key) == [(a, torch.float32), (b, torch.float32)]
    summed(c)  # A and B fill the cap: A, the least recently asked for, goes
    assert list(kept.by_key) == [(b, torch.float32), (c, torch.float32)]
    summed(b)
    summed(a)  # C is now the least recently asked for
    assert list(kept.by_key) == [(b, torch.float32), (a, torch.float32)]
    summed(a, b)  # float32 A and float64 B: past the cap together, MPI's path, nothing kept for them
    assert list(kept.by_key) == [(b, torch.float32), (a, torch.float32)]
    comm.free()
