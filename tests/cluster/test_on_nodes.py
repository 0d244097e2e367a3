"""On the emulated 2-node cluster only (``make test-cluster``): the hierarchical sum against MPI's, every solver.

These tests carry ``ranks()`` (no size of the ordinary suite) and ``cluster``: they run
where tests/cluster/fake-ssh made MPI see two nodes, and check that it did.
"""

import pytest
import torch
from mpi4py import MPI

import mpisolve
from mpisolve.comm.communicator import Communicator, mpi_buffer
from mpisolve.comm.shm import NodeAllreduce, node_group
from mpisolve.train.config import TrainConfig
from mpisolve.train.loop import Trainer

pytestmark = [pytest.mark.mpi(min_size=4), pytest.mark.cluster, pytest.mark.ranks()]


@pytest.fixture(scope="module")
def comm():
    comm = Communicator()
    assert comm.nodes == 2 and comm.local_size == comm.size // 2, "the emulated cluster has two nodes"
    return comm


@pytest.mark.parametrize("numel", [3, 50_000, 1_000_003])
def test_hierarchical_sum_equals_mpi_allreduce(comm, numel):
    group = node_group(comm)
    assert group is not None and group.cross is not None and group.cross.size == 2
    op = NodeAllreduce(group, numel, torch.float32)
    for round_ in range(2):
        # Integers below 2**24: every order of addition gives the same float32 sum.
        mine = torch.arange(numel, dtype=torch.float32).remainder_(1000 + round_).add_(comm.rank)
        want = mine.clone()
        comm.wait(comm.comm.Iallreduce(MPI.IN_PLACE, mpi_buffer(want), MPI.SUM), "reference")
        op.wait_writable()
        op.slot.copy_(mine)
        op.start()
        op.wait()
        assert torch.equal(op.result, want)
    op.free()


SOLVER_OPTIONS = {
    "lb-bsp": {"speeds": "1"},  # one speed per rank, filled in below
    "abs-sgd": {"micro_batch": "fixed"},
}


@pytest.mark.parametrize("solver", mpisolve.solvers())
def test_every_solver_trains_across_the_nodes(comm, solver, tmp_path_factory):
    options = dict(SOLVER_OPTIONS.get(solver, {}))
    if solver == "lb-bsp":
        options["speeds"] = ",".join(["1"] * comm.size)
    config = TrainConfig(solver=solver, model="mlp", batch_size=16, steps=3, eval_every=100, options=options)
    trainer = Trainer(config, comm, show=False)
    trainer.prepare()
    summary = trainer.run()
    vector = getattr(trainer.solver, "vector", None)
    if vector is not None:  # the elastic family's window: the inter-node path, detected, not forced
        assert vector.path == "internode" and not trainer.solver.options.force_internode
    trainer.close()
    assert summary["steps"] >= 3
    if trainer.solver.lockstep:
        params = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
        gathered = comm.allgather_object(params.tolist())
        assert all(g == gathered[0] for g in gathered), "the ranks' models differ"
