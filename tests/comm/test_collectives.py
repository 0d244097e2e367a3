"""mpisolve.allreduce against a plain reference, at every size the suite runs."""

import pytest
import torch

import mpisolve
from mpisolve.comm.communicator import Communicator

SHAPES = [(3, 4), (), (0,), (1,), (7,), (2, 1, 5)]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def rank_tensors(rank):
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(d) for s in SHAPES for d in DTYPES]


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4, 5, 8)
@pytest.mark.parametrize("op", ["sum", "average"])
def test_mixed_shapes_and_dtypes(op):
    comm = Communicator()
    mine = rank_tensors(comm.rank)
    originals = [t.clone() for t in mine]
    out = mpisolve.allreduce(mine, op=op, comm=comm.comm)
    everyone = [rank_tensors(r) for r in range(comm.size)]
    for i, (got, t) in enumerate(zip(out, mine)):
        assert got.shape == t.shape and got.dtype == t.dtype
        expected = sum(ts[i].double() for ts in everyone)
        if op == "average":
            expected = expected / comm.size
        torch.testing.assert_close(got.double(), expected, rtol=TOL[t.dtype], atol=TOL[t.dtype])
    for t, o in zip(mine, originals):
        assert torch.equal(t, o)  # inputs untouched


@pytest.mark.mpi(min_size=2)
def test_bad_input_is_named():
    with pytest.raises(ValueError, match="op must be one of"):
        mpisolve.allreduce([torch.zeros(1)], op="median")
    with pytest.raises(TypeError, match=r"tensors\[1\] has dtype torch.complex64"):
        mpisolve.allreduce([torch.zeros(1), torch.zeros(1, dtype=torch.complex64)], op="max")


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_an_mpi4py_communicator_is_wrapped_once_and_freed_with_it():
    # Wrapped anew on every call, each call made a Split_type, an allreduce and Adasum's
    # splits, and never freed them: MPICH ran out of communicators after about 2000 calls.
    from mpi4py import MPI

    from mpisolve.comm.communicator import as_communicator

    sub = MPI.COMM_WORLD.Split(0, MPI.COMM_WORLD.Get_rank())
    mine = [torch.full((5,), 1.0 + sub.Get_rank())]
    wrapper = as_communicator(sub)
    mpisolve.allreduce(mine, op="adasum", comm=sub)
    made = dict(wrapper._named_splits)  # Adasum's level splits
    for op in ("sum", "adasum", "sum", "adasum"):
        mpisolve.allreduce(mine, op=op, comm=sub)
    # Another mpi4py object of the same communicator finds the same wrapper.
    (total,) = mpisolve.allreduce(mine, op="sum", comm=MPI.Intracomm(sub))
    assert total.tolist() == [sum(1.0 + r for r in range(sub.Get_size()))] * 5
    assert as_communicator(sub) is wrapper and as_communicator(MPI.Intracomm(sub)) is wrapper
    assert made and wrapper._named_splits == made  # made once, reused
    sub.Free()  # frees what the wrapper made, on every rank
    splits = [c for c in made.values() if c is not None]
    assert wrapper.node == MPI.COMM_NULL and all(c.comm == MPI.COMM_NULL for c in splits)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("node_shm", [True, False])
@pytest.mark.parametrize("op", ["sum", "average", "adasum"])
@pytest.mark.parametrize("count", [1, 2])
def test_parameters_that_require_grad_are_reduced_as_plain_tensors(op, node_shm, count):
    """A model's parameters go in as they are: the results carry no autograd graph, and
    neither does any memory kept for the next call."""
    comm = Communicator(node_shm=node_shm)
    params = [torch.nn.Parameter(torch.full((4, 3), float(comm.rank))), torch.nn.Parameter(torch.ones(5))][:count]
    wants = [torch.full((4, 3), float(sum(range(comm.size)))), torch.full((5,), float(comm.size))][:count]
    for _ in range(2):  # the second call reuses what the first kept
        out = mpisolve.allreduce(params, op=op, comm=comm)
        assert not any(t.requires_grad for t in out) and all(t.grad_fn is None for t in out)
        if op != "adasum":  # Adasum of these (not orthogonal) inputs is not their sum
            for got, want in zip(out, wants):
                torch.testing.assert_close(got, want if op == "sum" else want / comm.size)
    comm.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("node_shm", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["scalar", "contiguous", "transposed", "large"])
def test_one_tensor_alone_is_reduced_into_a_result_of_its_own(layout, dtype, node_shm):
    """A single tensor (a loss, a metric) takes no fusing: each result is right, of the
    input's shape and dtype, and stays so when the next call reuses what this one kept."""
    comm = Communicator(node_shm=node_shm)

    def mine(rank, call):
        if layout == "large":  # over 1 MiB: packed by the fused kernel
            return ((torch.arange(300_000, dtype=torch.float64) % 97) * (rank + 1) + call).to(dtype)
        t = torch.arange(15, dtype=torch.float64).view(3, 5) * (rank + 1) + call
        return {"scalar": t.sum(), "contiguous": t, "transposed": t.t()}[layout].to(dtype)

    results = []
    for call in range(2):
        (got,) = mpisolve.allreduce([mine(comm.rank, call)], op="average", comm=comm)
        results.append(got)
    for call, got in enumerate(results):
        want = sum(mine(r, call).double() for r in range(comm.size)) / comm.size
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=TOL[dtype], atol=TOL[dtype])
    comm.free()
