"""``hvd.allreduce`` of one tensor: one message once the ranks agreed its signature.

Either message: one MPI call, or one node-shared round with no MPI call at all (on one
node). The MPI calls are counted on the communicators themselves (each mpi4py communicator
behind the calls wrapped in a counter); the sums are checked against numpy's sum of
every rank's input (small integers: exact in any order). Ranks whose calls differ in
shape, dtype, reduction or scales get :class:`HorovodInternalError` on every rank, and
the next call works; a joined rank answers calls of an agreed signature. At 2 and 3 ranks, and
on the emulated 2-node clusters (a node-shared round there crosses between the nodes).
"""

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

import mpisolve
import mpisolve.horovod as hvd
from mpisolve.comm import Communicator, onetensor
from mpisolve.comm.onetensor import one_tensor
from mpisolve.comm.ops import tensor_ops

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.ranks(2, 3), pytest.mark.cluster]


@pytest.fixture(scope="module", autouse=True, params=["mpi", "node"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Horovod started, one tensor's message taken through MPI at every size (inline up to 128 KiB),
    or through node-shared memory at every size (where node-shared sums apply: one node here)."""
    hvd.init()
    one = one_tensor(hvd.global_process_set.comm)
    if request.param == "node" and one.group is None:
        pytest.skip("node-shared sums do not apply here")
    kept = one.node_min_bytes, one.inline_max_bytes
    one.node_min_bytes = sys.maxsize if request.param == "mpi" else 0
    one.inline_max_bytes = 1 << 17
    yield request.param
    one.node_min_bytes, one.inline_max_bytes = kept


class Counted:
    """An mpi4py communicator that records the name of each method called on it."""

    def __init__(self, comm: Any) -> None:
        self.inner, self.calls = comm, []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def called(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return attr(*args, **kwargs)

        return called


@contextmanager
def counted() -> Iterator[dict[str, Counted]]:
    """The MPI calls of the world's one-tensor sums and of its checked collectives (headers, data)."""
    world = hvd.global_process_set.comm
    assert world is not None
    ops = tensor_ops(world)
    comms: dict[str, Communicator] = {"sums": one_tensor(world).sums, "headers": ops.hdr, "data": ops.data}
    counters = {key: Counted(comm.comm) for key, comm in comms.items()}
    for key, comm in comms.items():
        comm.comm = counters[key]  # type: ignore[assignment]
    try:
        yield counters
    finally:
        for key, comm in comms.items():
            comm.comm = counters[key].inner


def mine_and_total(numel: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """This rank's input and numpy's sum of every rank's."""

    def of(rank: int) -> np.ndarray:
        return np.random.default_rng(seed * 100 + rank).integers(-50, 50, numel).astype(np.float32)

    return torch.from_numpy(of(hvd.rank())), np.sum([of(r) for r in range(hvd.size())], axis=0)


@pytest.mark.parametrize("numel", [1, 17, 4096, 40_000])
def test_each_call_after_the_first_is_one_message_and_sums_exactly(path, numel):
    tensor, total = mine_and_total(numel, numel)
    hvd.allreduce(tensor, op=hvd.Sum, name="agreeing")  # the signature agreed
    calls = [
        lambda: hvd.allreduce(tensor, op=hvd.Sum, name="blocking"),
        lambda: hvd.allreduce_(tensor.clone(), op=hvd.Sum),
        lambda: hvd.synchronize(hvd.allreduce_async(tensor, op=hvd.Sum)),
        lambda: hvd.synchronize(hvd.allreduce_async_(tensor.clone(), op=hvd.Sum)),
    ]
    message = one_tensor(hvd.global_process_set.comm).message
    if path == "mpi" and numel > 1 << 15:  # past 128 KiB: the flag's own allreduce, then the values'
        assert message is None
        return
    assert isinstance(message, onetensor.InlineMessage if path == "mpi" else onetensor.NodeMessage)
    for call in calls:
        if isinstance(message, onetensor.InlineMessage):
            persistent = message.persistent
            message.persistent = Counted(persistent)  # type: ignore[assignment]
        else:
            rounds = message.node_sum._seq
        try:
            with counted() as mpi:
                summed = call()
        finally:
            if isinstance(message, onetensor.InlineMessage):
                started, message.persistent = message.persistent.calls.count("Start"), persistent  # type: ignore[attr-defined]
            else:
                started = message.node_sum._seq - rounds
        # One start of the agreed signature's message; nothing else on any communicator.
        assert (started, mpi["sums"].calls, mpi["headers"].calls, mpi["data"].calls) == (1, [], [], [])
        np.testing.assert_array_equal(summed.numpy(), total)
    scaled = hvd.allreduce(tensor, op=hvd.Average, prescale_factor=2.0, postscale_factor=0.25)
    torch.testing.assert_close(scaled, torch.from_numpy(total * 2.0 / hvd.size() * 0.25))


def test_started_calls_run_in_order_when_waited_for_and_a_name_in_flight_is_refused():
    inputs = [mine_and_total(5, seed) for seed in range(6)]
    handles = [hvd.allreduce_async(t, op=hvd.Sum, name=f"call{i}") for i, (t, _) in enumerate(inputs)]
    with counted() as mpi:
        assert not any(hvd.poll(h) for h in handles)  # started, not yet run: a first poll does not block
        with pytest.raises(ValueError, match="already in flight"):
            hvd.allreduce_async(inputs[0][0], name="call0")
    assert not mpi["sums"].calls
    for h, (_, total) in zip(handles, inputs):
        np.testing.assert_array_equal(hvd.synchronize(h).numpy(), total)


@pytest.mark.parametrize("form", ["one", "list", "adasum"])
def test_mpisolve_allreduce_runs_after_horovod_calls_started_before_it_however_often_each_rank_polled(form):
    """Horovod's poll is local: a rank that polls a started call twice runs it there, another runs it when
    it waits. ``mpisolve.allreduce`` on the same communicator in between runs after it on every rank (as
    ``hvd.allreduce`` would), not paired with it on some: every result against numpy."""
    a, a_total = mine_and_total(8, seed=1)
    b, b_total = mine_and_total(8, seed=2)
    c, c_total = mine_and_total(3, seed=3)
    hvd.allreduce(torch.zeros(8), op=hvd.Sum)  # agreed: the started call and the direct one go in its message
    handle = hvd.allreduce_async(a, op=hvd.Sum)
    hvd.poll(handle)
    if hvd.rank() == 0:
        hvd.poll(handle)  # the second poll runs it, here alone
    if form == "one":
        np.testing.assert_array_equal(mpisolve.allreduce(b, op="sum").numpy(), b_total)
    elif form == "list":
        got = mpisolve.allreduce([b, c], op="sum")
        np.testing.assert_array_equal(got[0].numpy(), b_total)
        np.testing.assert_array_equal(got[1].numpy(), c_total)
    else:  # every rank's input the same: Adasum of equal vectors is that vector
        same = torch.arange(8, dtype=torch.float32)
        np.testing.assert_allclose(mpisolve.allreduce(same, op="adasum").numpy(), same.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(hvd.synchronize(handle).numpy(), a_total)


@pytest.mark.parametrize(
    "differs",
    [
        {"tensor": torch.ones(4)},
        {"tensor": torch.ones(2, 3)},
        {"tensor": torch.ones(6, dtype=torch.float64)},
        {"tensor": torch.ones(6, dtype=torch.int32)},
        {"op": hvd.Average},
        {"op": hvd.Max},
        {"prescale_factor": 2.0},
        {"postscale_factor": 0.5},
    ],
    ids=["elements", "shape", "float64", "int32", "average", "max", "prescale", "postscale"],
)
def test_a_call_that_differs_on_one_rank_raises_on_every_rank_and_the_next_call_works(differs):
    agreed: dict[str, Any] = {"tensor": torch.ones(6), "op": hvd.Sum}
    hvd.allreduce(**agreed)  # every rank agrees this signature first
    odd = hvd.rank() == hvd.size() - 1
    with pytest.raises(hvd.HorovodInternalError, match=r"differ: rank 0 has float32 \[6\] \(sum\)"):
        hvd.allreduce(**({**agreed, **differs} if odd else agreed))
    assert hvd.allreduce(**agreed).tolist() == [float(hvd.size())] * 6


@pytest.mark.parametrize("numel", [3, 20_000, 40_000, 300_000])
def test_a_joined_rank_answers_calls_of_the_agreed_signature(path, numel):
    size, rank = hvd.size(), hvd.rank()
    tensor = torch.full((numel,), 3.0)
    assert hvd.allreduce(tensor, op=hvd.Sum)[0].item() == 3.0 * size  # agreed on every rank
    agreed = one_tensor(hvd.global_process_set.comm).agreed
    inline = onetensor.INLINE if numel <= 1 << 15 else onetensor.SEPARATE
    assert agreed is not None and agreed[1] == (inline if path == "mpi" else onetensor.NODE)
    if rank == 0:
        last = hvd.join()
    else:
        for _ in range(2):
            assert hvd.allreduce(tensor, op=hvd.Sum).eq(3.0 * (size - 1)).all()  # rank 0 gave zeros
        torch.testing.assert_close(hvd.allreduce(torch.ones(2), op=hvd.Average), torch.full((2,), (size - 1) / size))
        last = hvd.join()
    assert last == size - 1
    assert hvd.allreduce(tensor, op=hvd.Sum).eq(3.0 * size).all()


def test_a_call_run_at_its_turn_in_a_barrier_lets_the_barrier_complete(path):
    """Horovod's duplicate-name test: rank 0's call runs at its turn inside its barrier, and the
    others start theirs only once that barrier is through, which it is only if rank 0's wait for
    its call moves MPI (its posted barrier) meanwhile, as MPI's own waits do."""
    tensor = torch.ones(17 * 17 * 17)
    assert hvd.allreduce(tensor, op=hvd.Sum).eq(hvd.size()).all()  # agreed on every rank
    handle = hvd.allreduce_async(tensor, op=hvd.Sum) if hvd.rank() == 0 else None
    if hvd.rank() > 0:
        time.sleep(0.5)  # rank 0's barrier posted first: the others' then needs it moved
    hvd.barrier()
    if hvd.rank() > 0:
        handle = hvd.allreduce_async(tensor, op=hvd.Sum)
    hvd.barrier()
    assert handle is not None and hvd.synchronize(handle).eq(hvd.size()).all()


SHAPES = {"A": (17,), "B": (2, 3), "C": (40,), "D": (5,)}
OPS = {"A": hvd.Sum, "B": hvd.Average, "C": hvd.Sum, "D": hvd.Sum}


def call(name: str) -> None:
    """Allreduce signature ``name``'s tensor, checked against numpy (every rank's inputs, exact)."""
    tensor, total = mine_and_total(int(np.prod(SHAPES[name])), seed=ord(name))
    expected = total if OPS[name] == hvd.Sum else total / hvd.size()
    got = hvd.allreduce(tensor.view(SHAPES[name]), op=OPS[name])
    np.testing.assert_array_equal(got.reshape(-1).numpy(), expected)


@pytest.mark.parametrize("cycle", ["AB", "ABAC", "ABCD", "AAB"])
def test_calls_that_repeat_a_cycle_of_signatures_are_each_one_message_once_learned(path, cycle):
    """A loop over a few signatures (a metric and a vector; each parameter in turn, one repeated) is
    agreed while the ranks learn its cycle, twice round; from then on each call is its message alone."""
    for _ in range(3):
        for name in cycle:
            call(name)
    with counted() as mpi:
        for _ in range(3):
            for name in cycle:
                call(name)
    assert (mpi["sums"].calls, mpi["headers"].calls, mpi["data"].calls) == ([], [], [])


def test_a_call_off_the_learned_cycle_is_agreed_anew_and_one_rank_off_it_raises_on_every_rank(path):
    for _ in range(3):
        call("A"), call("B")
    call("C")  # every rank off the cycle: agreed anew
    for _ in range(3):
        call("A"), call("B")  # learned again
    with counted() as mpi:
        call("A"), call("B")
    assert mpi["sums"].calls == []
    odd = hvd.rank() == hvd.size() - 1
    with pytest.raises(hvd.HorovodInternalError, match=r"differ: rank 0 has float32 \[17\] \(sum\)"):
        call("C" if odd else "A")
    call("A"), call("B")


def test_a_joined_rank_answers_calls_along_a_learned_cycle(path):
    size = hvd.size()
    for _ in range(3):
        call("A"), call("B")
    a, b = torch.full(SHAPES["A"], 3.0), torch.full(SHAPES["B"], 3.0)
    if hvd.rank() == 0:
        last = hvd.join()
    else:
        for _ in range(2):
            assert hvd.allreduce(a, op=hvd.Sum).eq(3.0 * (size - 1)).all()  # rank 0 gave zeros
            assert hvd.allreduce(b, op=hvd.Sum).eq(3.0 * (size - 1)).all()
        last = hvd.join()
    assert last == size - 1
    call("A"), call("B")


def test_a_cycle_of_more_signatures_than_are_kept_is_agreed_at_each_call_and_sums_exactly(monkeypatch):
    monkeypatch.setattr(onetensor, "SIGNATURES_KEPT", 2)
    comm = Communicator()
    one = one_tensor(comm)
    assert one.entries.count == 2
    for _ in range(4):
        for name in "ABC":
            tensor, total = mine_and_total(int(np.prod(SHAPES[name])), seed=ord(name))
            got = mpisolve.allreduce(tensor.view(SHAPES[name]), op="sum", comm=comm)
            np.testing.assert_array_equal(got.reshape(-1).numpy(), total)
            assert len(one.entries.by_key) <= 2 and one._cycle == []
    comm.free()


def test_signatures_whose_windows_pass_the_byte_bound_together_are_agreed_at_each_call_and_sum_exactly():
    """Two node-shared messages whose windows fit the bound on kept windows alone but not together: each call
    frees the other's window, so no cycle is learned over them; a cycle learned while both fitted is
    forgotten once a third signature's window takes the room of one of them. Sums exact throughout."""
    comm = Communicator()
    one = one_tensor(comm)
    if one.group is None:
        comm.free()
        pytest.skip("node-shared sums do not apply here")
    one.node_min_bytes = 0
    size = {name: int(np.prod(shape)) for name, shape in SHAPES.items()}
    window = {name: one._window_bytes(size[name], torch.float32) for name in SHAPES}

    def call_on(name: str) -> None:
        tensor, total = mine_and_total(size[name], seed=ord(name))
        got = mpisolve.allreduce(tensor.view(SHAPES[name]), op="sum", comm=comm)
        np.testing.assert_array_equal(got.reshape(-1).numpy(), total)
        assert one.entries.nbytes <= one.entries.keep_bytes

    one.entries.keep_bytes = max(window["A"], window["C"])
    for _ in range(4):
        call_on("A"), call_on("C")
        assert len(one.entries.by_key) == 1 and one._cycle == []
    one.entries.keep_bytes = window["A"] + window["C"]
    for _ in range(3):
        call_on("A"), call_on("C")
    assert len(one._cycle) == 2  # learned: both kept
    call_on("D")  # off the cycle, and its window takes A's room (the least recently agreed)
    assert one._cycle == [] and len(one.entries.by_key) == 2
    for _ in range(3):
        call_on("A"), call_on("C")
    comm.free()


#: Signatures for random call sequences: (dtype, shape, op, prescale, postscale). float16 takes the general path.
RANDOM_SIGNATURES = [
    (torch.float32, (17,), "sum", 1.0, 1.0),
    (torch.float32, (2, 3), "average", 1.0, 1.0),
    (torch.float64, (40,), "sum", 0.5, 2.0),
    (torch.float32, (300,), "sum", 1.0, 1.0),  # separate where MPI takes it (past inline_max_bytes below)
    (torch.float16, (9,), "sum", 1.0, 1.0),
    (torch.float32, (17,), "average", 2.0, 0.25),
]


def random_calls(rng: np.random.Generator, calls: int) -> list[int]:
    """A sequence of signatures' indices as loops make them: a short cycle repeated, at times a call
    off it, at times another cycle (the same on every rank: the same seed)."""
    made: list[int] = []
    while len(made) < calls:
        cycle = list(rng.integers(0, len(RANDOM_SIGNATURES), rng.integers(1, 6)))
        for _ in range(rng.integers(2, 8)):
            made += cycle
            if rng.random() < 0.2:
                made.append(int(rng.integers(0, len(RANDOM_SIGNATURES))))
    return made[:calls]


@pytest.mark.parametrize("kept", [64, 3])
def test_random_sequences_of_signatures_sum_exactly_with_messages_evicted_by_either_bound(path, kept, monkeypatch):
    """Calls going round cycles, leaving them and changing cycle, over every kind of message (inline or
    node-shared, separate, general, scaled), with the count bound at its default or at 3 signatures and
    the byte bound at two windows: every sum against numpy's."""
    monkeypatch.setattr(onetensor, "SIGNATURES_KEPT", kept)
    comm = Communicator()
    one = one_tensor(comm)
    one.node_min_bytes = sys.maxsize if path == "mpi" else 0
    one.inline_max_bytes = 1024
    if one.group is not None:
        one.entries.keep_bytes = 2 * one._window_bytes(300, torch.float32)
    size, rank = comm.size, comm.rank
    cycles: list[int] = []  # the learned cycle's length after each call
    for step, which in enumerate(random_calls(np.random.default_rng(7), 400)):
        dtype, shape, op, prescale, postscale = RANDOM_SIGNATURES[which]
        numel = int(np.prod(shape))

        def of(r: int, numel: int = numel, step: int = step) -> np.ndarray:
            return (np.arange(numel) % 7 + r + step % 5).astype(np.float64)

        tensor = torch.from_numpy(of(rank)).to(dtype).view(shape)
        if (prescale, postscale) == (1.0, 1.0):
            got = mpisolve.allreduce(tensor, op=op, comm=comm)
        else:
            got = one.allreduce(tensor, op, (prescale, postscale))
            assert got is not None  # every rank works: the agreed mode is never the general one here
        np_dtype = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}[dtype]
        expected = np.sum([of(r) for r in range(size)], axis=0).astype(np_dtype) * np_dtype(prescale)
        if op == "average":
            expected = expected / np_dtype(size)
        expected = expected * np_dtype(postscale)
        np.testing.assert_array_equal(got.reshape(-1).numpy(), expected, err_msg=f"call {step}")
        assert len(one.entries.by_key) <= kept and one.entries.nbytes <= one.entries.keep_bytes
        cycles.append(len(one._cycle))
    assert max(cycles) >= 3 and cycles.count(0) < 2 * len(cycles) // 3  # a third of the calls along a cycle
    comm.free()
