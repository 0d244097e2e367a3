"""Non-finite values on one rank, every solver: skipped alike (or alone, when asynchronous), or an error.

Also: Adasum when one rank contributes nothing (a zero update).
"""

import pytest
import torch

import mpisolve
from mpisolve.errors import NonFiniteError
from mpisolve.options import option_fields
from mpisolve.solvers.base import solver_class
from mpisolve.solvers.elastic import _LocalSteps

#: Solvers whose steps do not each apply an update (delayed rounds, periodic averages): the
#: checks below assume one update per step. They check non-finite values too (abs-sgd the
#: round's mean, local-sgd each local step), untested here.
NOT_ONE_UPDATE_PER_STEP = {"abs-sgd", "local-sgd"}


def build(name, **options):
    """(model, solver, whether this rank is the one that gets the NaN: the last)."""
    if name in NOT_ONE_UPDATE_PER_STEP:
        pytest.skip(f"{name} does not apply one update per step")
    comm = mpisolve.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if "tau" in option_fields(solver_class(name).Options):
        options["tau"] = 1000  # no exchange during the test: each rank's model shows its own steps
    return model, mpisolve.make_solver(name, model, optimizer, comm, **options), comm.rank == comm.size - 1


def step(solver, model, poisoned):
    solver.zero_grad()
    x = torch.randn(6, 4)
    if poisoned:
        x[0, 0] = float("nan")
    torch.nn.functional.cross_entropy(model(x), torch.zeros(6, dtype=torch.long)).backward()
    return solver.step()


def params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(3)
@pytest.mark.parametrize("name", mpisolve.solver_names())
def test_nonfinite_step_is_skipped(name):
    model, solver, bad = build(name, nonfinite="skip")
    assert step(solver, model, poisoned=False).applied
    before = params(model)
    info = step(solver, model, poisoned=bad)
    # Synchronous solvers skip on every rank alike; the local-step family (easgd included:
    # its exchange is every tau steps) skips on the poisoned rank alone, easgd still
    # reporting the step as applied so every rank counts the same steps.
    alone = isinstance(solver, _LocalSteps)
    skipped_here = bad if alone else bad or solver.lockstep
    assert info.applied is (not skipped_here or (alone and solver.lockstep))
    assert solver.nonfinite.skipped == int(skipped_here)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) is skipped_here
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert step(solver, model, poisoned=False).applied
    solver.close()
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the result (e.g. the center) too


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(3)
@pytest.mark.parametrize("name", mpisolve.solver_names())
def test_nonfinite_step_raises_by_default(name):
    model, solver, bad = build(name)
    # Synchronous solvers raise on every rank alike; the local-step family on the rank that holds it.
    if bad or (solver.lockstep and not isinstance(solver, _LocalSteps)):
        where = "on some rank" if solver.lockstep and name == "adasum" else ""
        with pytest.raises(NonFiniteError, match=f"solver '{name}': non-finite value .*{where}"):
            step(solver, model, poisoned=bad)
    else:
        assert step(solver, model, poisoned=False).applied
    solver.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("mode", ["delta", "gradient"])
def test_adasum_with_one_rank_contributing_nothing(mode):
    """Adasum(g, 0) = g: a rank with a zero update neither breaks nor dilutes the others'."""
    model, solver, idle = build("adasum", mode=mode)
    comm = solver.comm
    before = params(model)
    solver.zero_grad()
    torch.manual_seed(1 + comm.rank)
    loss = torch.nn.functional.cross_entropy(model(torch.randn(6, 4)), torch.zeros(6, dtype=torch.long))
    (loss * (0.0 if idle else 1.0)).backward()
    info = solver.step()
    assert info.applied
    after = params(model)
    assert all(torch.isfinite(p).all() for p in after)
    moved = sum((a - b).abs().sum().item() for a, b in zip(after, before))
    assert moved > 0 and len(set(comm.allgather_object(tuple(p.sum().item() for p in after)))) == 1
    if comm.size == 2:  # the combination is the busy rank's own update, unscaled
        mine = torch.cat([(a - b).reshape(-1) for a, b in zip(after, before)])
        update = comm.bcast_object(
            None if idle else (torch.cat([p.grad.reshape(-1) for p in model.parameters()]) * -0.1).tolist(), root=0
        )
        torch.testing.assert_close(mine, torch.tensor(update), rtol=1e-5, atol=1e-7)
    solver.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("node_shm", [True, False])
@pytest.mark.parametrize("policy", ["raise", "skip"])
@pytest.mark.parametrize("which", range(4))
def test_every_bucket_is_checked(node_shm, policy, which):
    """Each bucket's finite probe is taken as its sum completes: an Inf in any one bucket, on one rank, is caught
    on every rank (node-shared sums and MPI's path)."""
    comm = mpisolve.Communicator(node_shm=node_shm)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    solver = mpisolve.make_solver(
        "allreduce", model, torch.optim.SGD(model.parameters(), lr=0.1), comm, bucket_mb=1e-6, nonfinite=policy
    )
    assert len(solver.grads.buckets) == 4  # a bucket per parameter
    assert step(solver, model, poisoned=False).applied
    if comm.rank == comm.size - 1:
        poisoned = list(model.parameters())[which]
        poisoned.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    before = params(model)
    if policy == "raise":
        with pytest.raises(NonFiniteError, match="'allreduce': non-finite value"):
            step(solver, model, poisoned=False)
    else:
        assert not step(solver, model, poisoned=False).applied
        assert solver.nonfinite.skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    solver.close()
