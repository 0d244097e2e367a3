"""Optimizers that write ``p.grad`` in place train right on both sum paths.

On the node-shared bandwidth path a step's gradients are one sum in node-shared memory that
every local rank's optimizer reads at once. ``SGD(nesterov=True, foreach=True)`` adds its
momentum into ``p.grad`` in place, and so does an optimizer of the user's that scales it
(through ``p.grad`` or ``p.grad.data``): each such optimizer must get its own copy. Every
case here trains as one process does with the same optimizer on every rank's samples. The
bandwidth path is forced here at every size (the model is tiny).

Before the fix the in-place writers made the ranks' models differ on the node-shared path
(and agree on MPI's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
from torch import nn

from mpisolve.comm import shm

from .harness import (
    LR,
    SGD_RULE,
    all_raised,
    all_ranks_equal,
    assert_close,
    cases,
    flat,
    global_batch,
    loss_fn,
    make_model,
    shard,
)

STEPS = 4


class HalvingSGD(torch.optim.Optimizer):
    """A user's optimizer: halves ``p.grad`` in place (from step ``start`` on), then steps on it."""

    def __init__(self, params: Sequence[nn.Parameter], lr: float, *, through_data: bool = False, start: int = 1):
        super().__init__(params, {"lr": lr})
        self.through_data = through_data
        self.start = start
        self.steps = 0

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        self.steps += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self.steps >= self.start:
                    (p.grad.data if self.through_data else p.grad).mul_(0.5)
                p.add_(p.grad, alpha=-group["lr"])


OPTIMIZERS: dict[str, Callable[[Sequence[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd-nesterov-foreach": lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, nesterov=True, foreach=True),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=True),
    "users-halving": lambda ps: HalvingSGD(ps, LR),
    "users-halving-through-data": lambda ps: HalvingSGD(ps, LR, through_data=True),
}


@pytest.fixture(scope="module", autouse=True)
def bandwidth_path() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shm, "LATENCY_MAX_BYTES", 0)
        yield


def one_process(optimizer: str, size: int) -> torch.Tensor:
    model = make_model()
    opt = OPTIMIZERS[optimizer](list(model.parameters()))
    for k in range(STEPS):
        x, y = global_batch(k, size)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return flat(model)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("case", cases(SGD_RULE), ids=lambda c: c.id)
def test_optimizers_that_write_the_gradients_train_as_one_process(on, case, optimizer):
    model = make_model()
    solver = case.build(model, OPTIMIZERS[optimizer](list(model.parameters())), on)
    for k in range(STEPS):
        x, y = shard(global_batch(k, on.size), on.rank)
        solver.zero_grad()
        loss_fn(model(x), y).backward()
        solver.step()
    got = flat(model)
    solver.close()
    assert all_ranks_equal(on, got), f"{case.id} with {optimizer}: the ranks' models differ"
    assert_close(got, one_process(optimizer, on.size), f"{case.id} with {optimizer}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_an_optimizer_that_starts_writing_the_shared_sums_later_is_an_error(comm):
    model = make_model()
    solver = cases(("allreduce",))[0].build(model, HalvingSGD(list(model.parameters()), LR, start=3), comm)
    error: Exception | None = None
    try:
        for k in range(STEPS):
            x, y = shard(global_batch(k, comm.size), comm.rank)
            solver.zero_grad()
            loss_fn(model(x), y).backward()
            solver.step()
    except RuntimeError as err:
        error = err
    solver.close()
    messages = all_raised(comm, error)
    assert all(m is not None and "MPISOLVE_NODE_SHM=0" in m for m in messages), messages
