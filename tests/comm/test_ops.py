"""mpisolve's checked collectives (allreduce of any dtype, allgather, broadcast, alltoall,
reducescatter, join, process sets) against numpy on every rank's inputs, at 2 and 3 ranks."""

import numpy as np
import pytest
import torch

import mpisolve
from mpisolve.comm.ops import META, scatter_rows, tensor_ops

INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
NUMPY_REDUCE = {"sum": np.sum, "min": np.min, "max": np.max, "product": np.prod}


def values(rank, shape, dtype, low=-3, high=4):
    """This rank's input, made alike on every rank from its number (so each can build the oracle)."""
    g = np.random.default_rng(100 + rank)
    if dtype == torch.uint8:
        low = 0
    return torch.from_numpy(g.integers(low, high, size=shape)).to(dtype)


@pytest.fixture(scope="module")
def world():
    return mpisolve.init()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("op", ["sum", "min", "max", "product", "average"])
@pytest.mark.parametrize("dtype", [*INTS, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(3, 4), (40, 20)], ids=["in-the-header", "data-round"])
def test_allreduce_of_one_tensor_is_numpys_reduction(world, op, dtype, shape):
    got = mpisolve.allreduce(values(world.rank, shape, dtype), op=op)
    everyone = np.stack([values(r, shape, dtype).double().numpy() for r in range(world.size)])
    if op == "average":
        want = np.sum(everyone, axis=0) / world.size
        want = want if dtype.is_floating_point else np.trunc(want)
    else:
        want = NUMPY_REDUCE[op](everyone, axis=0)
    assert isinstance(got, torch.Tensor) and got.dtype == dtype and got.shape == shape
    if not dtype.is_floating_point:  # integers wrap as the dtype does
        want = torch.from_numpy(want).to(torch.int64).to(dtype).double().numpy()
    rtol = {torch.float16: 1e-3, torch.float32: 1e-6}.get(dtype, 1e-12)
    np.testing.assert_allclose(got.double().numpy(), want, rtol=rtol)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize(
    ("mine", "theirs", "says"),
    [
        ((torch.ones(4), "sum"), (torch.ones(4, dtype=torch.int64), "sum"), r"float32 \[4\] \(sum\).*int64 \[4\]"),
        ((torch.ones(4, dtype=torch.int32), "max"), (torch.ones(5, dtype=torch.int32), "max"), r"int32 \[4\].*\[5\]"),
        ((torch.ones(4), "sum"), (torch.ones(4), "max"), r"\(sum\).*\(max\)"),
        ((torch.ones(4), "max"), (torch.ones(4), "max"), None),
    ],
    ids=["float-int", "int-shapes", "reductions", "same"],
)
def test_one_tensor_whose_dtype_shape_or_reduction_differs_raises_on_every_rank_whatever_its_path(mine, theirs, says):
    """One tensor's signature is checked across ranks on every path (a float sum's one message, the general
    path of an int or a max): where the last rank's differs, every rank raises naming both (none waits for
    a collective the others never make), and the next call works."""
    comm = mpisolve.Communicator(timeout_s=20)
    tensor, op = theirs if comm.rank == comm.size - 1 else mine
    if says is None:
        assert torch.equal(mpisolve.allreduce(tensor, op=op, comm=comm), tensor)
    else:
        with pytest.raises(mpisolve.TensorMismatchError, match=says):
            mpisolve.allreduce(tensor, op=op, comm=comm)
    assert torch.equal(mpisolve.allreduce(torch.ones(3), op="sum", comm=comm), torch.full((3,), float(comm.size)))
    comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_bool_min_max_and_grouped_mixed_dtypes(world):
    flags = torch.tensor([True, world.rank == 0, world.rank > 0])
    assert mpisolve.allreduce(flags, op="max").tolist() == [True, True, True]
    assert mpisolve.allreduce(flags, op="min").tolist() == [True, False, False]
    mixed = [values(world.rank, (2,), torch.int32), values(world.rank, (3, 1), torch.float64)]
    got = mpisolve.allreduce(mixed, op="max")
    for i, t in enumerate(got):
        want = np.max([values(r, mixed[i].shape, mixed[i].dtype).numpy() for r in range(world.size)], axis=0)
        assert t.dtype == mixed[i].dtype
        np.testing.assert_array_equal(t.numpy(), want)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64, torch.bfloat16, torch.float32, torch.bool])
def test_allgather_with_uneven_first_dimensions(world, dtype):
    mine = values(world.rank, (world.rank + 1, 2, 3), dtype, 0, 2)
    got = mpisolve.allgather(mine)
    want = np.concatenate([values(r, (r + 1, 2, 3), dtype, 0, 2).float().numpy() for r in range(world.size)])
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.float().numpy(), want)
    assert mpisolve.allgather(torch.zeros(0, 2, 3, dtype=dtype)).shape == (0, 2, 3)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_broadcast_from_every_root_leaves_the_input(world):
    for root in range(world.size):
        mine = values(world.rank, (4, 2), torch.int16)
        before = mine.clone()
        got = mpisolve.broadcast(mine, root=root)
        np.testing.assert_array_equal(got.numpy(), values(root, (4, 2), torch.int16).numpy())
        assert torch.equal(mine, before)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_alltoall_with_splits_is_the_transposed_exchange(world):
    size, rank = world.size, world.rank

    def splits_of(r):
        return [(r + k) % 3 for k in range(size)]  # some ranks send nothing to some

    def rows_of(r):
        return values(r, (sum(splits_of(r)), 2), torch.float64)

    got, received = mpisolve.alltoall(rows_of(rank), splits=splits_of(rank))
    pieces = []
    for r in range(size):
        start = sum(splits_of(r)[:rank])
        pieces.append(rows_of(r).numpy()[start : start + splits_of(r)[rank]])
    assert received == [splits_of(r)[rank] for r in range(size)]
    np.testing.assert_array_equal(got.numpy(), np.concatenate(pieces))
    even, received = mpisolve.alltoall(torch.arange(2 * size) + 10 * rank)
    assert received == [2] * size and even.tolist() == [
        v for r in range(size) for v in (10 * r + 2 * rank, 10 * r + 2 * rank + 1)
    ]


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("op", ["sum", "average", "max"])
def test_reducescatter_keeps_this_ranks_rows(world, op):
    rows = 2 * world.size + 1  # uneven: the first ranks take one more
    got = mpisolve.reducescatter(values(world.rank, (rows, 3), torch.float64), op=op)
    everyone = np.stack([values(r, (rows, 3), torch.float64).numpy() for r in range(world.size)])
    full = {"sum": everyone.sum(0), "average": everyone.mean(0), "max": everyone.max(0)}[op]
    counts = scatter_rows(rows, world.size)
    start = sum(counts[: world.rank])
    np.testing.assert_allclose(got.numpy(), full[start : start + counts[world.rank]], rtol=1e-12)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_mismatches_raise_on_every_rank_and_the_next_call_works(world):
    rank = world.rank
    cases = [
        lambda: mpisolve.allreduce(torch.zeros(3 + rank, dtype=torch.int32), op="sum"),  # shape
        lambda: mpisolve.allreduce(torch.zeros(3, dtype=torch.int32 if rank else torch.int64), op="max"),  # dtype
        lambda: mpisolve.allgather(torch.zeros(2, 1 + rank)),  # a dimension after the first
        lambda: mpisolve.broadcast(torch.zeros(2), root=rank),  # roots
        lambda: mpisolve.reducescatter(torch.zeros(4), op="sum" if rank else "max"),  # reductions
    ]
    for case in cases:
        with pytest.raises(mpisolve.TensorMismatchError, match="differ"):
            case()
    assert mpisolve.allreduce(torch.ones(2, dtype=torch.int64), op="sum").tolist() == [world.size] * 2
    with pytest.raises(ValueError, match="splits sum to 3 rows, but the tensor has 2"):
        mpisolve.alltoall(torch.zeros(2), splits=[1] * (world.size - 1) + [3 - world.size + 1])


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_overlapping_calls_complete_in_any_order(world):
    ops = tensor_ops()
    started = [ops.start("allreduce", [torch.full((5,), i + world.rank, dtype=torch.int64)]) for i in range(4)]
    started.append(ops.start("allgather", [torch.full((world.rank + 1,), 7)]))
    gathered = started.pop().wait()
    assert gathered[0].tolist() == [7] * (world.size * (world.size + 1) // 2)
    for i, pending in reversed(list(enumerate(started))):
        assert pending.wait()[0].tolist() == [world.size * i + sum(range(world.size))] * 5
    named = None
    if world.rank == 0:  # in flight until the others start theirs, after the barrier
        named = ops.start("allreduce", [torch.zeros(1)], name="x")
        with pytest.raises(ValueError, match="already in flight"):
            ops.start("allreduce", [torch.zeros(1)], name="x")
    ops.barrier()
    if world.rank > 0:
        named = ops.start("allreduce", [torch.zeros(1)], name="x")
    assert named is not None and named.wait()[0].item() == 0.0
    ops.start("allreduce", [torch.zeros(1)], name="x").wait()  # the name is free again


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_sizes_past_the_header_take_a_round_of_their_own(world):
    count = META + 6
    tensors = [torch.full((world.rank + (i % 3),), float(i)) for i in range(count)]
    got = mpisolve.allgather(tensors)
    for i, g in enumerate(got):
        assert g.tolist() == [float(i)] * sum(r + (i % 3) for r in range(world.size))


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_a_joined_rank_answers_allreduces_and_the_last_to_join_is_returned(world):
    ops = tensor_ops()
    if world.rank == 0:
        last = ops.join()
    else:
        total = ops.start("allreduce", [torch.full((3,), 2, dtype=torch.int32)], op="sum").wait()[0]
        large = ops.start("allreduce", [torch.full((META * 8,), 2, dtype=torch.int32)], op="sum").wait()[0]
        assert large.tolist() == [2 * (world.size - 1)] * META * 8  # too large for the header: a data round
        low = ops.start("allreduce", [torch.full((2,), float(world.rank))], op="min").wait()[0]
        assert total.tolist() == [2 * (world.size - 1)] * 3  # rank 0 gave zeros
        assert low.tolist() == [1.0, 1.0]  # rank 0 gave min's identity
        with pytest.raises(mpisolve.TensorMismatchError, match="rank\\(s\\) 0 have joined"):
            ops.start("allgather", [torch.zeros(1)]).wait()
        last = ops.join()
    assert last == world.size - 1  # the working ranks joined together; the highest is named


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_process_sets_reduce_among_their_ranks(world):
    evens = mpisolve.process_set(range(0, world.size, 2))
    odds = mpisolve.process_set(range(1, world.size, 2))
    mine = evens if world.rank % 2 == 0 else odds
    assert (evens is None) == (world.rank % 2 == 1) and mine is not None
    got = mpisolve.allreduce(torch.tensor([world.rank]), op="sum", comm=mine)
    assert got.item() == sum(range(world.rank % 2, world.size, 2))
    last = mpisolve.broadcast(torch.tensor([world.rank]), root=mine.size - 1, comm=mine)  # in the header
    assert last.item() == list(range(world.rank % 2, world.size, 2))[-1]
    mine.free()
    with pytest.raises(ValueError, match="distinct ranks"):
        mpisolve.process_set([0, 0])


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("numel", [5, META * 8], ids=["in-the-header", "data-round"])
def test_a_grouped_broadcast_of_every_dtype_is_the_roots_values(world, numel):
    dtypes = [*INTS, torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64]
    shapes = [(numel,), (), (0, 3), (2, 3)]
    for root in range(world.size):

        def group(rank):
            made = [values(rank, shapes[i % len(shapes)], dtype, 0, 2) for i, dtype in enumerate(dtypes)]
            made.append(values(rank, (3, 4), torch.float32).t())  # not contiguous
            return made

        got = mpisolve.broadcast(group(world.rank), root=root)
        for g, want in zip(got, group(root)):
            assert g.dtype == want.dtype and g.shape == want.shape
            np.testing.assert_array_equal(g.float().numpy(), want.float().numpy())
        into = [torch.zeros_like(t) for t in group(world.rank)]
        same = tensor_ops().start("broadcast", group(world.rank), root=root, out=into).wait()
        assert all(a is b for a, b in zip(same, into))
        for g, want in zip(into, group(root)):
            np.testing.assert_array_equal(g.float().numpy(), want.float().numpy())


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_started_broadcasts_in_the_header_complete_in_any_order(world):
    ops = tensor_ops()
    started = [ops.start("broadcast", [torch.full((2,), 10 * world.rank + i)], root=i % world.size) for i in range(4)]
    summed = ops.start("allreduce", [torch.ones(3, dtype=torch.int64)] * 2, op="sum")
    assert [t.tolist() for t in summed.wait()] == [[world.size] * 3] * 2
    for i, pending in reversed(list(enumerate(started))):
        assert pending.wait()[0].tolist() == [10 * (i % world.size) + i] * 2


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_a_small_broadcast_mismatch_raises_on_every_rank_and_a_joined_rank_is_refused(world):
    rank = world.rank
    cases = [
        lambda: mpisolve.broadcast(torch.zeros(2 + rank), root=1),  # shape
        lambda: mpisolve.broadcast(torch.zeros(2, dtype=torch.float16 if rank else torch.bfloat16), root=1),  # dtype
        lambda: mpisolve.broadcast([torch.zeros(2)] * (1 + rank), root=1),  # tensor count
    ]
    for case in cases:
        with pytest.raises(mpisolve.TensorMismatchError, match="differ"):
            case()
    ops = tensor_ops()
    if rank == 0:
        last = ops.join()
    else:
        with pytest.raises(mpisolve.TensorMismatchError, match="rank\\(s\\) 0 have joined"):
            ops.start("broadcast", [torch.ones(3, dtype=torch.int8)], root=1).wait()
        last = ops.join()
    assert last == world.size - 1
    assert mpisolve.broadcast(torch.full((3,), rank, dtype=torch.int8), root=1).tolist() == [1, 1, 1]


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("prescale", [1.0, 0.5])
def test_a_grouped_allreduce_in_the_header_of_mixed_layouts_is_numpys(world, prescale):
    def group(rank):
        return [
            values(rank, (3,), torch.int32),
            values(rank, (2, 3), torch.float64).t(),  # not contiguous
            values(rank, (), torch.float16),
            values(rank, (5,), torch.uint8, 0, 4),
            values(rank, (4,), torch.float32),
            values(rank, (0,), torch.int8),
        ]

    got = tensor_ops().start("allreduce", group(world.rank), op="sum", prescale=prescale).wait()
    for i, g in enumerate(got):
        mine = group(world.rank)[i]
        scaled = [group(r)[i].double() * prescale for r in range(world.size)]
        if not mine.dtype.is_floating_point:
            scaled = [s.trunc() for s in scaled]  # an integer's prescale truncates, as its dtype would
        want = torch.stack(scaled).sum(0).to(mine.dtype)
        assert g.dtype == mine.dtype and g.shape == mine.shape
        np.testing.assert_allclose(g.double().numpy(), want.double().numpy(), rtol=1e-3)
