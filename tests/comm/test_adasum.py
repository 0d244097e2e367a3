"""mpisolve.allreduce(op="adasum") on real ranks: Adasum's oracles and a numpy reference."""

import numpy as np
import pytest
import torch

import mpisolve
from mpisolve.comm.adasum import Adasum
from mpisolve.comm.communicator import Communicator
from mpisolve.errors import CommTimeout
from tests.adasum_reference import tree

# Sizes 0, 1 and below every rank count the suite runs, odd sizes that put VHDD's cuts
# inside tensors, and one large enough for every rank to hold a piece of it.
SHAPES = [(3, 4), (), (0,), (1,), (2,), (7,), (2, 1, 5), (257,), (1000, 3)]
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def rank_tensors(rank, dtype, shapes=SHAPES):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


def assert_matches(got, expected, dtype, scale=1.0):
    tol = TOL[dtype] * scale
    np.testing.assert_allclose(got.double().numpy().ravel(), expected, rtol=tol, atol=tol)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4, 5, 8)
@pytest.mark.parametrize("engine", ["mpi", "gloo"])
def test_random_tensors_match_the_reference_tree(engine):
    comm = Communicator(engine=engine)  # gloo: the pairwise steps are its sends and receives
    # Mixed dtypes in one call: float64 alone, the float32 wire of float32/16/bfloat16.
    mine = [t for d in DTYPES for t in rank_tensors(comm.rank, d)]
    originals = [t.clone() for t in mine]
    out = mpisolve.allreduce(mine, op="adasum", comm=comm)
    everyone = [[t for d in DTYPES for t in rank_tensors(r, d)] for r in range(comm.size)]
    for i, (got, t) in enumerate(zip(out, mine)):
        assert got.shape == t.shape and got.dtype == t.dtype
        expected = tree([everyone[r][i].double().numpy() for r in range(comm.size)])
        # Half inputs are combined in float32; the tolerance is their own rounding.
        assert_matches(got, expected, t.dtype)
    assert all(torch.equal(t, o) for t, o in zip(mine, originals))  # inputs untouched


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4, 5)
@pytest.mark.parametrize("dtype", DTYPES)
def test_identical_inputs_give_the_input_back(dtype):
    comm = Communicator()
    same = rank_tensors(0, dtype)
    out = mpisolve.allreduce(same, op="adasum", comm=comm)
    for got, t in zip(out, same):
        torch.testing.assert_close(got, t, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4, 5)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_orthogonal_inputs_give_their_sum(dtype):
    comm = Communicator()
    # Rank r's tensor is nonzero on coordinates r, r + P, r + 2P, ...: mutually orthogonal.
    n = 4 * comm.size + 3
    full = torch.randn(n, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(dtype)
    mask = (torch.arange(n) % comm.size) == comm.rank
    mine = torch.where(mask, full, torch.zeros_like(full))
    (out,) = mpisolve.allreduce([mine], op="adasum", comm=comm)
    torch.testing.assert_close(out, full, rtol=0, atol=0)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4, 5, 8)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_parallel_inputs_give_their_mean_at_any_rank_count(dtype):
    comm = Communicator()
    a = torch.randn(37, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    # Parallel and anti-parallel, of unlike norms (as Horovod's stability tests take them).
    scales = [(-1) ** r * (0.5 + 3 * r) for r in range(comm.size)]
    (out,) = mpisolve.allreduce([(a * scales[comm.rank]).to(dtype)], op="adasum", comm=comm)
    # Each pair weighs its sides by the ranks under them, so every rank counts alike: numpy's mean.
    expected = np.mean([(a * s).to(dtype).double().numpy() for s in scales], axis=0)
    assert_matches(out, expected, dtype)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4, 5, 8)
@pytest.mark.parametrize("engine", ["mpi", "gloo"])
def test_zero_inputs_leave_the_mean_of_the_others(engine):
    comm = Communicator(engine=engine)
    a = torch.randn(29, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    scales = [(-1) ** r * (0.5 + 3 * r) for r in range(comm.size)]
    # Tensor i is zero on the ranks r with (r + i) % 3 == 0 (a rank under join(), a layer no loss
    # reached there), somewhere below, beside and above the pairs a fold makes.
    present = [[(r + i) % 3 != 0 for r in range(comm.size)] for i in range(3)]
    mine = [a * scales[comm.rank] * present[i][comm.rank] for i in range(3)]
    out = mpisolve.allreduce(mine, op="adasum", comm=comm)
    for i, got in enumerate(out):
        alike = [a.numpy() * s for s, here in zip(scales, present[i]) if here]
        expected = np.mean(alike, axis=0) if alike else np.zeros(29)
        assert_matches(got, expected, torch.float64)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4, 5)
def test_scaling_all_inputs_scales_the_result():
    comm = Communicator()
    mine = rank_tensors(comm.rank, torch.float64)
    out = mpisolve.allreduce(mine, op="adasum", comm=comm)
    scaled = mpisolve.allreduce([3.0 * t for t in mine], op="adasum", comm=comm)
    for o, s in zip(out, scaled):
        torch.testing.assert_close(s, 3.0 * o, rtol=1e-12, atol=1e-12)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4, 5)
def test_zero_tensors_pass_through_as_a_plain_sum():
    comm = Communicator()
    g = torch.Generator().manual_seed(11)
    others = torch.randn(9, generator=g, dtype=torch.float64)
    # Tensor 0 is zero everywhere; tensor 1 is zero except on the last rank.
    mine = [
        torch.zeros(5, dtype=torch.float64),
        others if comm.rank == comm.size - 1 else torch.zeros(9, dtype=torch.float64),
    ]
    zero, one = mpisolve.allreduce(mine, op="adasum", comm=comm)
    assert torch.equal(zero, torch.zeros(5, dtype=torch.float64))
    assert torch.equal(one, others)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_bad_input_is_named():
    with pytest.raises(ValueError, match="'adasum'"):
        mpisolve.allreduce([torch.zeros(1)], op="adasam")
    with pytest.raises(TypeError, match=r"tensors\[0\] has dtype torch.int32"):
        mpisolve.allreduce([torch.zeros(1, dtype=torch.int32)], op="adasum")


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("engine", ["mpi", "gloo"])
def test_watchdog_names_the_stage_a_reduction_is_stuck_at(engine):
    comm = Communicator(engine=engine, timeout_s=60)
    if engine == "gloo":
        comm.torch_group()  # gloo's own timeout (the communicator's when it is made) outlasts the watchdog's
    comm.timeout_s = 0.5
    adasum = Adasum(comm)
    flat = torch.ones(10, dtype=torch.float64)
    reduction = adasum.reduction(flat, [6, 4])
    late = comm.size - 1  # starts only after the others timed out
    # At 3 ranks, rank 1 folds into rank 0, which then pairs with rank 2 (the late one).
    stuck = {2: ["level 1 exchange with rank 1"], 3: ["level 1 exchange with rank 2", "fold: result from rank 0"]}
    if comm.rank != late:
        adasum.start(reduction)
        message = rf"adasum of the test buffer \({stuck[comm.size][comm.rank]}\) did not complete within 0.5 s"
        with pytest.raises(CommTimeout, match=message):
            adasum.finish(reduction, "adasum of the test buffer")
    comm.comm.Barrier()
    comm.timeout_s = 60
    if comm.rank == late:
        adasum.start(reduction)
    adasum.finish(reduction)  # the late rank joined: the same reduction completes
    assert torch.equal(flat, torch.ones(10, dtype=torch.float64))
    reduction.free()
