"""On the emulated 2-node cluster only (``make test-cluster``): what only several nodes show.

These tests carry ``ranks()`` (no size of the ordinary suite) and ``cluster``: they run
where tests/cluster/fake-ssh made MPI see two nodes, and check that it did. The same run
takes the other tests marked ``cluster``: the node-shared sums and buckets
(tests/comm/test_shm.py) and the conformance suite's step API for every solver
(tests/conformance: join, zeroing, clipping after ``synchronize``, GradScaler,
``no_sync``), every node-shared sum there on its bandwidth path.
"""

import pytest
import torch
from mpi4py import MPI

import mpisolve
from mpisolve.comm.communicator import Communicator, mpi_buffer
from mpisolve.comm.shm import NodeAllreduce, node_group
from tests.conformance.harness import LR, make_model

pytestmark = [pytest.mark.mpi(min_size=4), pytest.mark.cluster, pytest.mark.ranks()]


@pytest.fixture(scope="module")
def comm():
    comm = Communicator()
    assert comm.nodes == 2 and comm.local_size == comm.size // 2, "the emulated cluster has two nodes"
    return comm


def test_ranks_waiting_count_the_hosts_cores_not_the_nodes(comm):
    """The two emulated nodes share this machine's cores: ``auto`` yields once the host is oversubscribed."""
    assert comm.host_size == comm.size
    auto = Communicator(wait="auto")
    assert auto.wait_policy == ("yield" if comm.size > comm.cores else "spin")
    auto.free()


def test_hierarchical_sums_equal_mpi_allreduce(comm):
    group = node_group(comm)
    assert group is not None and group.cross is not None and group.cross.size == 2
    ops = [NodeAllreduce(group, numel, torch.float32) for numel in (3, 50_000)]  # latency and bandwidth paths
    assert [op.latency for op in ops] == [True, False]
    for round_ in range(2):
        wants = []
        for op in ops:
            # Integers below 2**24: every order of addition gives the same float32 sum.
            mine = torch.arange(op.numel, dtype=torch.float32).remainder_(1000 + round_).add_(comm.rank)
            want = mine.clone()
            comm.wait(comm.comm.Iallreduce(MPI.IN_PLACE, mpi_buffer(want), MPI.SUM), "reference")
            wants.append(want)
            op.wait_writable()
            op.input.copy_(mine)
            op.start()
        for op, want in zip(ops[::-1], wants[::-1]):  # completed in another order than started
            op.wait()
            assert torch.equal(op.result, want)
    for op in ops:
        op.free()


WINDOW_SOLVERS = ("async-sgd", "async-msgd", "hogwild-sgd", "async-easgd", "async-measgd", "ea-wild")


@pytest.mark.parametrize("solver", WINDOW_SOLVERS)
def test_the_window_solvers_detect_the_internode_path(comm, solver):
    model = make_model()
    trained = mpisolve.make_solver(solver, model, torch.optim.SGD(model.parameters(), lr=LR), comm)
    try:
        assert trained.vector.path == "internode" and not trained.options.force_internode  # type: ignore[attr-defined]
    finally:
        trained.close()
