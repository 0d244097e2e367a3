"""The non-finite check on one rank: what counts as non-finite, the policies, the option."""

import pytest
import torch

import mpisolve
from mpisolve.errors import NonFiniteError, OptionError
from mpisolve.solvers.nonfinite import MAX_CONSECUTIVE_SKIPS, all_finite


def test_all_finite_finds_nan_and_inf_in_any_tensor_and_dtype():
    ok = [torch.ones(3), torch.zeros(2, 2, dtype=torch.float64), torch.ones(4, dtype=torch.bfloat16)]
    assert all_finite(ok) and all_finite([]) and all_finite(ok[:1])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for i in range(len(ok)):
            tensors = [t.clone() for t in ok]
            tensors[i].view(-1)[-1] = bad
            assert not all_finite(tensors)
    assert all_finite([torch.full((1000,), 1e30)])  # large but finite values are not flagged


def nan_step(solver, model):
    solver.zero_grad()
    model(torch.full((2, 3), float("nan"))).sum().backward()
    return solver.step()


def test_skip_leaves_the_model_and_counts_and_raise_names_the_problem():
    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    solver = mpisolve.make_solver("allreduce", model, torch.optim.SGD(model.parameters(), lr=0.1), nonfinite="skip")
    info = nan_step(solver, model)
    assert not info.applied and info.global_samples == 0 and solver.nonfinite.skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert solver.state_dict()["nonfinite_skipped"] == 1
    solver.close()
    strict = mpisolve.make_solver("allreduce", model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert strict.options.nonfinite == "raise"  # the default
    with pytest.raises(NonFiniteError, match="solver 'allreduce': non-finite value .* averaged gradients .* step 1"):
        nan_step(strict, model)
    strict.close()


def test_skip_stops_a_diverged_run_instead_of_spinning():
    """A skipped step leaves the model as it was, so a model whose every gradient overflows
    would be skipped forever: after MAX_CONSECUTIVE_SKIPS in a row the job stops, and a
    finite step in between restarts the count."""
    model = torch.nn.Linear(3, 2)
    solver = mpisolve.make_solver("allreduce", model, torch.optim.SGD(model.parameters(), lr=0.0), nonfinite="skip")
    for _ in range(MAX_CONSECUTIVE_SKIPS - 1):
        assert not nan_step(solver, model).applied
    solver.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    assert solver.step().applied
    for _ in range(MAX_CONSECUTIVE_SKIPS - 1):
        nan_step(solver, model)
    with pytest.raises(NonFiniteError, match=f"non-finite at {MAX_CONSECUTIVE_SKIPS} steps in a row.*diverged"):
        nan_step(solver, model)
    solver.close()


def test_every_solver_takes_the_option_and_checks_its_value():
    for name in mpisolve.solver_names():
        cls = mpisolve.solvers.base.solver_class(name)
        assert cls.Options(nonfinite="skip").nonfinite == "skip"
    model = torch.nn.Linear(3, 2)
    with pytest.raises(OptionError, match="option 'nonfinite' of solver 'allreduce' must be one of"):
        mpisolve.make_solver("allreduce", model, torch.optim.SGD(model.parameters(), lr=0.1), nonfinite="maybe")
