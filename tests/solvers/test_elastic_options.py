"""The EASGD family's options and construction checks, on one rank."""

import pytest
import torch

import mpisolve
from mpisolve.errors import OptionError, UnsupportedModelError

FAMILY = ["easgd", "async-sgd", "async-msgd", "hogwild-sgd", "async-easgd", "async-measgd", "ea-wild"]


def build(name, lr=0.1, sgd_momentum=0.0, model=None, **options):
    model = model or torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=sgd_momentum)
    return mpisolve.make_solver(name, model, optimizer, **options)


def test_every_solver_is_registered():
    assert set(FAMILY) <= set(mpisolve.solver_names())


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("easgd", {"tau": 0}, "tau must be >= 1"),
        ("async-easgd", {"alpha": 0.1, "rho": 1.0}, "alpha or rho, not both"),
        ("ea-wild", {"alpha": 1.5}, r"alpha must be in \(0, 1\]"),
        ("ea-wild", {"rho": -1.0}, "rho must be > 0"),
        ("async-easgd", {"rho": 20.0}, r"alpha = lr \* rho must be in \(0, 1\]"),
        ("async-sgd", {"layout": "ring"}, "option 'layout' .* must be one of 'sharded', 'server'"),
        ("hogwild-sgd", {"progress": "magic"}, "option 'progress' .* must be one of 'auto', 'thread', 'mpich', 'none'"),
        ("async-msgd", {"momentum": 1.0}, r"momentum must be in \[0, 1\)"),
        ("async-measgd", {"momentum": -0.1}, r"momentum must be in \[0, 1\)"),
        ("easgd", {"layout": "sharded"}, "does not take option 'layout'"),
        ("async-sgd", {"momentum": 0.9}, "does not take option 'momentum'"),
        ("async-sgd", {"force_internode": "yes"}, "must be bool"),
    ],
)
def test_bad_options_are_named(name, options, message):
    with pytest.raises(OptionError, match=message):
        build(name, **options)


@pytest.mark.parametrize("name", ["async-msgd", "async-measgd"])
def test_momentum_variants_refuse_an_optimizer_with_momentum(name):
    with pytest.raises(OptionError, match="applies its own momentum"):
        build(name, sgd_momentum=0.9)


def test_parameters_must_share_a_float_dtype_on_the_cpu():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).half())
    with pytest.raises(UnsupportedModelError, match="one dtype, float32 or float64"):
        build("ea-wild", model=model)


def test_mpich_progress_needs_the_environment(monkeypatch):
    monkeypatch.delenv("MPICH_ASYNC_PROGRESS", raising=False)
    with pytest.raises(OptionError, match="MPICH_ASYNC_PROGRESS=1"):
        build("ea-wild", progress="mpich")


@pytest.mark.parametrize("name", FAMILY)
def test_single_rank_run_leaves_its_center_in_the_model(name):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with build(name, model=model, tau=2) as solver:
        for step in range(1, 5):
            solver.zero_grad()
            model(torch.randn(4, 3)).square().sum().backward()
            info = solver.step()
            assert info.applied and info.local_samples == 4
            # easgd (lockstep) counts a round's samples at its exchange; the others each step's
            assert info.global_samples == ((8 if step % 2 == 0 else 0) if name == "easgd" else 4)
        with solver.evaluating():
            center = [p.detach().clone() for p in model.parameters()]
    for p, c, b in zip(model.parameters(), center, before):
        torch.testing.assert_close(p.detach(), c)
        assert not torch.equal(c, b)
