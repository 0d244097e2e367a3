"""The conformance suite runs the node-shared path where it applies (see conftest.py)."""

import pytest
import torch

from mpisolve.comm.shm import NodePersistentAllreduce
from tests.conformance.conftest import BANDWIDTH_PATH
from tests.conformance.harness import BUCKETS, LR, cases, make_model

#: Bucket solvers whose gradients are summed in node-shared memory (Adasum brings its own reducer).
NODE_SHARED = ("allreduce", "kfac", "lb-bsp")


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("case", cases(BUCKETS), ids=lambda c: c.id)
def test_bucket_solvers_sum_in_node_shared_memory_where_ranks_share_a_node(comm, case):
    model = make_model()
    solver = case.build(model, torch.optim.SGD(model.parameters(), lr=LR), comm)
    try:
        node = solver.grads.node  # type: ignore[attr-defined]
        if case.id not in NODE_SHARED or comm.local_size == 1 or not comm.node_shm:
            assert node is None
        else:
            assert node is not None
            assert all(op.latency != BANDWIDTH_PATH for op in node.ops)
    finally:
        solver.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@pytest.mark.ranks(2, 3)
def test_abs_sgd_sums_its_rounds_in_node_shared_memory_where_ranks_share_a_node(comm):
    (case,) = cases(("abs-sgd",))
    model = make_model()
    solver = case.build(model, torch.optim.SGD(model.parameters(), lr=LR), comm)
    try:
        node_shared = [isinstance(r, NodePersistentAllreduce) for r in solver._rounds]  # type: ignore[attr-defined]
        assert node_shared == [comm.node_shm and comm.local_size > 1] * 2
        if node_shared[0]:
            assert all(r.op.latency != BANDWIDTH_PATH for r in solver._rounds)  # type: ignore[attr-defined]
    finally:
        solver.close()
