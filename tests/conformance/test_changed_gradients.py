"""A gradient changed in place between the start of its reduction (backward) and ``step()`` or
``synchronize()``: clipping right after ``backward()`` (DDP's habit), a ``scaler.unscale_``
of one's own, a hand-made ``p.grad.mul_``. Whether the reduction read the change depends on
timing, so the ranks' models could differ silently; instead the step raises, on every rank
that made the change, naming the fix (``synchronize()`` first). On both sum paths: node-shared
(at 2 ranks its bandwidth path, where the sum is read in place; at 3 the latency path) and MPI's.

Keeping ``optimizer.step()`` in place of ``solver.step()`` is refused at its first call, before
the optimizer steps, for every solver.

Before the fix the changed step went through: each rank's model took whatever its reduction
had read (different on the two paths), and ``optimizer.step()`` was reported at the second
backward as a gradient-accumulation problem.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from .harness import BUCKETS, LR, all_raised, assert_close, cases, global_batch, loss_fn, make_model, oracle, run, shard


def clip(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)


def scale(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
    model[0].weight.grad.mul_(2.0)


def unscale(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
    scaler.unscale_(optimizer)


CHANGES: dict[str, Callable[[torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler], None]] = {
    "clip": clip,
    "scale": scale,
    "unscale": unscale,
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("case", cases(BUCKETS), ids=lambda c: c.id)
def test_a_gradient_changed_before_synchronize_is_an_error_naming_the_fix(on, case, change):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    solver = case.build(model, optimizer, on)
    scaler = torch.amp.GradScaler("cpu")
    x, y = shard(global_batch(0, on.size), on.rank)
    solver.zero_grad()
    scaler.scale(loss_fn(model(x), y)).backward()
    CHANGES[change](model, optimizer, scaler)
    error: Exception | None = None
    try:
        solver.step(scaler=scaler)
    except RuntimeError as err:
        error = err
    solver.close()
    messages = all_raised(on, error)
    # A GradScaler's unscale_ writes behind autograd's version counters; the scaler says it was misused.
    said = "unscale_() has already been called" if change == "unscale" else "changed in place after"
    assert all(m is not None and said in m and "synchronize(" in m for m in messages), messages
    # Nothing was left in flight: a new solver trains as the documented loop.
    if case.id != "kfac":
        assert_close(run(case, on, 1), oracle(case, on, 1), case.id)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_keeping_optimizer_step_is_refused_at_the_first_step(comm, case):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    solver = case.build(model, optimizer, comm)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = shard(global_batch(0, comm.size), comm.rank)
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"optimizer.step\(\) was called directly.*solver.step\(\)"):
        optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # refused before stepping
    solver.step()  # the documented step still works after the refusal
    solver.close()
