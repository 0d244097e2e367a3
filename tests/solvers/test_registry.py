"""The solver registry and construction checks that need no second rank."""

import types

import pytest
import torch

import mpisolve
from mpisolve.errors import OptionError
from mpisolve.solvers.base import solver_class


def test_allreduce_is_registered():
    assert "allreduce" in mpisolve.solver_names()


def test_solvers_is_the_plain_subpackage():
    """``mpisolve.solvers`` is the package, not a callable stand-in; the names come from ``solver_names``."""
    assert type(mpisolve.solvers) is types.ModuleType
    assert mpisolve.solvers.solver_names is mpisolve.solver_names


def test_every_solver_class_is_named_for_what_it_is():
    """One naming rule: the class of a registered solver is ``<Name>Solver``."""
    assert [n for n in mpisolve.solver_names() if not solver_class(n).__name__.endswith("Solver")] == []


def test_unknown_solver_and_option_are_named():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(OptionError, match="unknown solver 'nope'"):
        mpisolve.make_solver("nope", model, opt)
    with pytest.raises(OptionError, match="does not take option 'bucket'"):
        mpisolve.make_solver("allreduce", model, opt, bucket=1)
    with pytest.raises(OptionError, match="bucket_mb must be > 0"):
        mpisolve.make_solver("allreduce", model, opt, bucket_mb=0)


def test_single_rank_step_is_plain_sgd():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    twin = torch.nn.Linear(3, 2)
    twin.load_state_dict(model.state_dict())
    x, y = torch.randn(5, 3), torch.randn(5, 2)
    with mpisolve.make_solver("allreduce", model, torch.optim.SGD(model.parameters(), lr=0.1)) as solver:
        solver.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        info = solver.step()
    assert info.applied and info.global_samples == 5 and info.local_samples == 5
    ref = torch.optim.SGD(twin.parameters(), lr=0.1)
    torch.nn.functional.mse_loss(twin(x), y).backward()
    ref.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", mpisolve.solver_names())
def test_a_solver_prints_its_name_rank_and_chosen_options(name):
    model = torch.nn.Linear(2, 2)
    chosen = {"nonfinite": "skip"}
    with mpisolve.make_solver(name, model, torch.optim.SGD(model.parameters(), lr=0.1), **chosen) as solver:
        shown = repr(solver)
        assert shown == str(solver) and " at 0x" not in shown
        registered = solver_class(name).__name__  # adasum's modes are private classes behind it
        assert isinstance(solver, solver_class(name))
        assert shown.startswith(f"{registered}('{name}', rank 0 of 1") and shown.endswith("nonfinite='skip')")
    assert "closed" in repr(solver)


def test_a_callable_option_is_printed_by_name():
    def damping(step):
        return 0.01

    model = torch.nn.Linear(2, 2)
    with mpisolve.make_solver("kfac", model, torch.optim.SGD(model.parameters(), lr=0.1), damping=damping) as solver:
        assert repr(solver) == "KFACSolver('kfac', rank 0 of 1, damping=damping)"


def test_adasum_is_one_name_over_a_class_per_mode():
    """Gradient mode is a bucket solver with Adasum's reducer; delta mode a solver of its own."""
    from mpisolve.solvers.base import BucketSolver

    for mode, buckets in (("gradient", True), ("delta", False)):
        model = torch.nn.Linear(2, 2)
        with mpisolve.make_solver("adasum", model, torch.optim.SGD(model.parameters(), lr=0.1), mode=mode) as solver:
            assert isinstance(solver, solver_class("adasum")) and isinstance(solver, BucketSolver) == buckets
