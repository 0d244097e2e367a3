"""The "kfac" solver in one process: the math contract, options, state, fallbacks."""

import copy
import math

import pytest
import torch
from torch import nn

import mpisolve
from mpisolve.comm.communicator import Communicator
from mpisolve.solvers.kfac.solver import VARIANTS


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 4 * 4, 5)
        self.out = nn.Linear(5, 2, bias=False)

    def forward(self, x):
        return self.out(torch.relu(self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))))


def exact_options(**extra):
    base = dict(method="eigen", factor_decay=0.0, kl_clip=None, factor_update_steps=1, inv_update_steps=1)
    return {**base, **extra}


def gradient_matrix(module):
    v = module.weight.grad.reshape(module.weight.shape[0], -1)
    return torch.cat([v, module.bias.grad[:, None]], dim=1) if module.bias is not None else v


def update_matrix(module, before):
    d = (before[0] - module.weight.detach()).reshape(module.weight.shape[0], -1)
    return torch.cat([d, (before[1] - module.bias.detach())[:, None]], dim=1) if module.bias is not None else d


@pytest.mark.parametrize("variant", VARIANTS)
def test_applied_direction_is_the_damped_kronecker_solve(variant):
    torch.manual_seed(0)
    model = Net().double()
    reference = copy.deepcopy(model)
    damping = 0.01
    solver = mpisolve.make_solver(
        "kfac", model, torch.optim.SGD(model.parameters(), lr=1.0), variant=variant, damping=damping, **exact_options()
    )
    x, y = torch.randn(6, 2, 4, 4, dtype=torch.float64), torch.randint(0, 2, (6,))
    nn.functional.cross_entropy(reference(x), y).backward()
    before = {name: [p.detach().clone() for p in m.parameters()] for name, m in model.named_children()}
    solver.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    solver.step()
    for layer in solver.layers:
        name = layer.spec.name
        v = gradient_matrix(getattr(reference, name))
        a, g = layer.a.matrix(), layer.g.matrix()  # this step's factors (factor_decay=0)
        dense = torch.kron(a, g) + damping * torch.eye(a.shape[0] * g.shape[0], dtype=torch.float64)
        expected = torch.linalg.solve(dense, v.T.reshape(-1)).view(v.shape[1], v.shape[0]).T
        torch.testing.assert_close(update_matrix(getattr(model, name), before[name]), expected, rtol=1e-9, atol=1e-12)
    # BatchNorm is not preconditioned: its update is the plain gradient.
    bn_grad = reference.bn.weight.grad
    torch.testing.assert_close(before["bn"][0] - model.bn.weight.detach(), bn_grad)
    solver.close()


def test_inverse_method_uses_factored_damping():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 3)).double()
    reference = copy.deepcopy(model)
    damping = 0.05
    solver = mpisolve.make_solver(
        "kfac", model, torch.optim.SGD(model.parameters(), lr=1.0), damping=damping, **exact_options(method="inverse")
    )
    x, target = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    nn.functional.mse_loss(reference(x), target).backward()
    before = [p.detach().clone() for p in model.parameters()]
    solver.zero_grad()
    nn.functional.mse_loss(model(x), target).backward()
    solver.step()
    layer = solver.layers[0]
    a, g = layer.a.matrix(), layer.g.matrix()
    pi = math.sqrt((a.trace() / a.shape[0]) / (g.trace() / g.shape[0]))
    root = math.sqrt(damping)
    v = gradient_matrix(reference[0])
    expected = torch.linalg.inv(g + root / pi * torch.eye(3, dtype=torch.float64)) @ v
    expected = expected @ torch.linalg.inv(a + root * pi * torch.eye(5, dtype=torch.float64))
    torch.testing.assert_close(update_matrix(model[0], before), expected, rtol=1e-9, atol=1e-12)
    # Damping never enters the stored factors.
    xbar = torch.cat([x, torch.ones(5, 1, dtype=torch.float64)], dim=1)
    torch.testing.assert_close(a, xbar.T @ xbar / 5)
    solver.close()


def test_running_average_kl_clip_and_schedules_in_a_plain_loop():
    torch.manual_seed(2)
    model = Net()
    seen = []
    solver = mpisolve.make_solver(
        "kfac",
        model,
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        factor_update_steps=2,
        inv_update_steps=4,
        kl_clip=1e-4,
        damping=lambda step: seen.append(step) or 0.01,
        lr=lambda step: 0.1 / (1 + step),
    )
    data = [(torch.randn(8, 2, 4, 4), torch.randint(0, 2, (8,))) for _ in range(6)]
    updates = []
    for x, y in data:
        solver.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        info = solver.step()
        assert info.applied and info.local_samples == 8 and info.global_samples == 8
        updates.append(solver.layers[0].a.updates)
        assert solver.optimizer.param_groups[0]["lr"] == 0.1  # the KL clip's lr is not the optimizer's
    assert updates == [1, 1, 2, 2, 3, 3]  # factors every 2 steps
    assert seen == [0, 4]  # damping read at inversion steps
    assert all(torch.isfinite(p).all() for p in model.parameters())
    solver.close()


def test_intervals_may_follow_a_schedule():
    torch.manual_seed(2)
    model = Net()
    solver = mpisolve.make_solver(
        "kfac",
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        factor_update_steps=lambda step: 1 if step < 2 else 3,  # KAISA's callables
        inv_update_steps=lambda step: 2 if step < 3 else 6,
    )
    factors, inverses = [], []
    for _ in range(8):
        x, y = torch.randn(8, 2, 4, 4), torch.randint(0, 2, (8,))
        solver.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        inverse = solver.layers[0].a.inverse.clone()
        solver.step()
        factors.append(solver.layers[0].a.updates)
        inverses.append(not torch.equal(inverse, solver.layers[0].a.inverse))
    assert factors == [1, 2, 2, 3, 3, 3, 4, 4]  # at steps s with s % schedule(s) == 0: 0, 1, 3, 6
    assert inverses == [True, False, True, False, False, False, True, False]  # 0, 2, 6
    solver.close()


@pytest.mark.parametrize("knob", ["factor_update_steps", "inv_update_steps"])
def test_an_interval_schedule_that_gives_no_positive_int_is_refused(knob):
    model = Net()
    solver = mpisolve.make_solver("kfac", model, torch.optim.SGD(model.parameters(), lr=0.1), **{knob: lambda s: 0})
    nn.functional.cross_entropy(model(torch.randn(4, 2, 4, 4)), torch.randint(0, 2, (4,))).backward()
    with pytest.raises(mpisolve.OptionError, match=f"the {knob} schedule gave 0 at step [01]: an int >= 1"):
        solver.step()
        solver.step()
    solver.close()


def test_lr_is_the_kl_clips_alone_as_kaisas():
    """The KL clip's nu = min(1, sqrt(kl_clip / (lr^2 |<U, V>|))): twice the lr, half the
    (clipped) step; the optimizer steps at its own lr either way."""
    updates = []
    for lr in (None, 0.2):
        torch.manual_seed(2)
        model = Net().double()  # updates of ~1e-4 on weights of ~0.1: float32 would round them
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        solver = mpisolve.make_solver("kfac", model, optimizer, lr=lr, **exact_options(kl_clip=1e-8))
        preconditioned = [p for name, p in model.named_parameters() if not name.startswith("bn.")]
        before = [p.detach().clone() for p in preconditioned]
        x = torch.randn(8, 2, 4, 4, dtype=torch.float64)
        nn.functional.cross_entropy(model(x), torch.randint(0, 2, (8,))).backward()
        solver.step()
        assert optimizer.param_groups[0]["lr"] == 0.1
        updates.append(torch.cat([(p - b).reshape(-1) for p, b in zip(preconditioned, before)]))
        solver.close()
    torch.testing.assert_close(updates[1], updates[0] / 2)


def test_the_kl_clip_reads_the_learning_rate_an_optimizer_state_loaded_later_gives():
    """optimizer.load_state_dict after make_solver (a resume, join()'s hand-over) makes new param
    groups: the KL clip reads their lr, not the replaced groups'."""
    updates = []
    for loaded in (False, True):
        torch.manual_seed(2)
        model = Net().double()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1 if loaded else 0.2)
        solver = mpisolve.make_solver("kfac", model, optimizer, **exact_options(kl_clip=1e-8))
        if loaded:
            state = optimizer.state_dict()
            state["param_groups"][0]["lr"] = 0.2
            optimizer.load_state_dict(state)
        before = [p.detach().clone() for p in model.parameters()]
        x = torch.randn(8, 2, 4, 4, dtype=torch.float64)
        nn.functional.cross_entropy(model(x), torch.randint(0, 2, (8,))).backward()
        solver.step()
        updates.append(torch.cat([(p - b).reshape(-1) for p, b in zip(model.parameters(), before)]))
        solver.close()
    torch.testing.assert_close(updates[1], updates[0])


def test_state_dict_round_trip_resumes_exactly():
    torch.manual_seed(3)
    data = [(torch.randn(4, 2, 4, 4), torch.randint(0, 2, (4,))) for _ in range(6)]
    opts = dict(factor_update_steps=1, inv_update_steps=2, method="eigen")

    def train(model, solver, batches):
        for x, y in batches:
            solver.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            solver.step()

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    solver = mpisolve.make_solver("kfac", model, optimizer, **opts)
    train(model, solver, data[:3])
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict(), solver.state_dict()))
    train(model, solver, data[3:])
    solver.close()

    resumed = Net()
    resumed_opt = torch.optim.SGD(resumed.parameters(), lr=0.1)
    resumed.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    other = mpisolve.make_solver("kfac", resumed, resumed_opt, **opts)
    other.load_state_dict(saved[2])
    assert other.steps == 3 and other.layers[0].a.updates == 3
    train(resumed, other, data[3:])
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    other.close()
    small = nn.Linear(3, 1)
    with mpisolve.make_solver("kfac", small, torch.optim.SGD(small.parameters(), lr=1)) as mismatched:
        with pytest.raises(ValueError, match="factors"):
            mismatched.load_state_dict(saved[2])


def test_non_finite_batch_factors_are_not_folded_in():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    solver = mpisolve.make_solver("kfac", model, optimizer, **exact_options(), nonfinite="skip")
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    solver.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    solver.step()
    kept = solver.layers[0].a.matrix()
    x[0, 0] = float("inf")
    solver.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.warns(RuntimeWarning, match=r"non-finite batch factors.*0\.A"):
        info = solver.step()
    assert torch.equal(solver.layers[0].a.matrix(), kept) and solver.layers[0].a.updates == 1
    assert not info.applied and solver.nonfinite.skipped == 1  # the gradients were not finite either
    solver.close()


def test_factor_that_cannot_be_decomposed_keeps_its_previous_inverse():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    solver = mpisolve.make_solver(
        "kfac", model, torch.optim.SGD(model.parameters(), lr=0.1), **exact_options(method="inverse", factor_decay=0.5)
    )
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    solver.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    solver.step()
    kept = solver.layers[1].a.inverse.clone()
    solver.layers[1].a.running.view(-1)[0] = float("nan")  # a stored factor gone bad
    solver.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.warns(RuntimeWarning, match=r"could not be decomposed.*2\.A.*previous decomposition"):
        solver.step()
    assert torch.equal(solver.layers[1].a.inverse, kept)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    solver.close()


def test_singular_factor_without_enough_damping_is_inverted_safely():
    model = nn.Sequential(nn.Linear(6, 2, bias=False))
    solver = mpisolve.make_solver(
        "kfac", model, torch.optim.SGD(model.parameters(), lr=0.1), damping=1e-12, **exact_options(method="inverse")
    )
    x = torch.ones(3, 6) * 1e3  # A is rank one with entries 1e6: Cholesky fails in float32
    solver.zero_grad()
    with pytest.warns(RuntimeWarning, match="float64 eigh|could not be decomposed"):
        model(x).pow(2).mean().backward()
        solver.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    solver.close()


def test_skipped_layers_keep_their_plain_gradient():
    torch.manual_seed(5)
    model = Net()
    reference = copy.deepcopy(model)
    solver = mpisolve.make_solver(
        "kfac", model, torch.optim.SGD(model.parameters(), lr=1.0), skip=["fc", nn.Conv2d], **exact_options()
    )
    assert [layer.spec.name for layer in solver.layers] == ["out"]
    x, y = torch.randn(4, 2, 4, 4), torch.randint(0, 2, (4,))
    nn.functional.cross_entropy(reference(x), y).backward()
    solver.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    solver.step()
    for name in ("fc", "conv"):
        for p, q in zip(getattr(model, name).parameters(), getattr(reference, name).parameters()):
            torch.testing.assert_close(p.detach(), (q - q.grad).detach())
    assert not torch.allclose(model.out.weight, (reference.out.weight - reference.out.weight.grad).detach())
    solver.close()


def test_layers_never_run_keep_their_plain_gradient():
    torch.manual_seed(5)
    model = nn.ModuleDict({"used": nn.Linear(3, 2), "unused": nn.Linear(2, 2)})
    solver = mpisolve.make_solver("kfac", model, torch.optim.SGD(model.parameters(), lr=1.0), **exact_options())
    before = model["unused"].weight.detach().clone()
    solver.zero_grad()
    model["used"](torch.randn(4, 3)).sum().backward()
    solver.step(batch_size=4)  # a ModuleDict is never called itself: the solver sees no forward to count
    assert torch.equal(model["unused"].weight.detach(), before)  # zero gradient, not preconditioned
    assert solver.layers[1].a.updates == 0 and not solver.layers[1].ready
    solver.close()


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(variant="x-kfac"), "variant"),
        (dict(damping=0.0), "damping must be > 0"),
        (dict(factor_decay=1.0), "factor_decay"),
        (dict(factor_update_steps=3, inv_update_steps=10), "multiple of factor_update_steps"),
        (dict(kl_clip=-1.0), "kl_clip"),
        (dict(variant="d-kfac", placement="balanced"), "placement applies to mpd-kfac and spd-kfac"),
        (dict(variant="mpd-kfac", fusion="dynamic"), "fusion applies to variant 'spd-kfac'"),
        (dict(skip=(3,)), "skip entries"),
        (dict(method="cholesky"), "method"),
    ],
)
def test_bad_options_are_refused_with_their_name(options, message):
    model = nn.Linear(2, 2)
    with pytest.raises(mpisolve.OptionError, match=message):
        mpisolve.make_solver("kfac", model, torch.optim.SGD(model.parameters(), lr=0.1), **options)


def test_a_model_without_layers_to_precondition_is_refused():
    model = nn.Sequential(nn.BatchNorm1d(3))
    with pytest.raises(mpisolve.OptionError, match="no Linear or Conv2d"):
        mpisolve.make_solver("kfac", model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_damping_schedule_must_stay_positive():
    model = nn.Linear(2, 2)
    solver = mpisolve.make_solver("kfac", model, torch.optim.SGD(model.parameters(), lr=0.1), damping=lambda step: 0.0)
    model(torch.randn(3, 2)).sum().backward()
    with pytest.raises(mpisolve.OptionError, match="damping schedule gave 0.0 at step 0"):
        solver.step()
    solver.close()


def test_all_variants_agree_in_one_process():
    results = []
    for variant in VARIANTS:
        torch.manual_seed(6)
        model = Net()
        solver = mpisolve.make_solver(
            "kfac",
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            comm=Communicator().comm,
            variant=variant,
            factor_update_steps=1,
            inv_update_steps=1,
        )
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            x, y = torch.randn(4, 2, 4, 4, generator=g), torch.randint(0, 2, (4,), generator=g)
            solver.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            solver.step()
        results.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        solver.close()
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    torch.testing.assert_close(results[0], results[2], rtol=1e-6, atol=1e-7)


def test_grad_worker_fraction_outside_zero_one_is_refused():
    model = nn.Linear(2, 2)
    with pytest.raises(mpisolve.OptionError, match="grad_worker_fraction must be in"):
        mpisolve.make_solver("kfac", model, torch.optim.SGD(model.parameters(), lr=0.1), grad_worker_fraction=1.5)


def test_every_option_has_a_one_line_help():
    import dataclasses

    for f in dataclasses.fields(mpisolve.solvers.kfac.KFACOptions):
        assert f.metadata.get("help") and "\n" not in f.metadata["help"], f.name
