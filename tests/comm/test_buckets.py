"""Bucket planning and gradient buckets (single process)."""

import pytest
import torch
from mpi4py import MPI

from mpisolve.comm.buckets import GradientBuckets, Unreduced, plan_buckets, wire_dtype
from mpisolve.comm.communicator import Communicator


def test_plan_buckets_respects_size_and_dtype():
    ts = [torch.zeros(10), torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(30), torch.zeros(1)]
    plan = plan_buckets(ts, bucket_bytes=80)
    assert sorted(i for b in plan for i in b) == [0, 1, 2, 3, 4]
    for bucket in plan:
        assert len({ts[i].dtype for i in bucket}) == 1
        assert bucket == sorted(bucket)
        if len(bucket) > 1:
            assert sum(ts[i].numel() * ts[i].element_size() for i in bucket) <= 80
    assert plan == sorted(plan, key=lambda b: b[0])
    assert [3] in plan  # larger than a bucket: a bucket of its own


def test_plan_buckets_rejects_nonpositive_size():
    with pytest.raises(ValueError, match="bucket size"):
        plan_buckets([torch.zeros(1)], 0)


def test_half_types_travel_as_float32_and_ints_are_refused():
    assert wire_dtype(torch.float16) == torch.float32
    assert wire_dtype(torch.bfloat16) == torch.float32
    assert wire_dtype(torch.float64) == torch.float64
    with pytest.raises(TypeError):
        wire_dtype(torch.int32)


def test_one_rank_has_no_buckets_and_leaves_the_gradients_as_backward_made_them():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)).to(torch.float16)
    reference = [p.detach().clone() for p in model.parameters()]
    grads = GradientBuckets(
        model.parameters(), Communicator(MPI.COMM_SELF), bucket_bytes=40, average=True, samples=lambda: 6
    )
    assert grads.alone and isinstance(grads.reducer, Unreduced) and not grads._hooks and not grads.buckets
    x = torch.randn(6, 5).to(torch.float16)
    plain = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)).to(torch.float16)
    for p, r in zip(plain.parameters(), reference):
        p.data.copy_(r)
    for _ in range(2):  # twice: the second step's gradients land in the zeroed buckets again
        grads.zero_()
        plain.zero_grad()
        model(x).float().square().sum().backward()
        plain(x).float().square().sum().backward()
        reduction = grads.finish(check_finite=True)
        assert (reduction.samples, reduction.ranks, reduction.finite) == (6, 1, True)
        for p, q in zip(model.parameters(), plain.parameters()):
            assert torch.equal(p.grad, q.grad)  # nothing scaled, copied through a float32 twin or summed
        grads.rearm()
    grads.close()
