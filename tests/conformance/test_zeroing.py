"""Zeroing the gradients any way works, for every solver: the documented update every step.
Each run zeroes one way per step, in turn, so that every way follows a step zeroed another.

Before the fix, on the bucket solvers, zeroing by anything but ``solver.zero_grad()``
left the buckets unarmed from the second step on: each rank applied its own gradient
divided by the ranks, and the ranks' models drifted apart.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from .harness import BATCH, BY_ID, ROUNDS, assert_close, cases, expected, global_batch, loss_fn, run, settle, shard


def _none(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


ZEROING: dict[str, Callable[[object, nn.Module, torch.optim.Optimizer], None]] = {
    "solver.zero_grad": lambda solver, model, opt: solver.zero_grad(),  # type: ignore[attr-defined]
    "optimizer.zero_grad": lambda solver, model, opt: opt.zero_grad(),
    "optimizer.zero_grad(set_to_none=False)": lambda solver, model, opt: opt.zero_grad(set_to_none=False),
    "model.zero_grad": lambda solver, model, opt: model.zero_grad(),
    "p.grad = None": lambda solver, model, opt: _none(model),
}
#: One step per way, each after a step zeroed another way (the documented way first).
ORDER = list(ZEROING)
STEPS = len(ORDER)


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_any_zeroing_gives_the_documented_update(comm, case):
    infos = []

    def step(solver, model, optimizer, k):
        x, y = shard(global_batch(k, comm.size), comm.rank)
        ZEROING[ORDER[k]](solver, model, optimizer)
        loss_fn(model(x), y).backward()
        infos.append(solver.step())
        settle(solver)

    got = run(case, comm, STEPS, step)
    assert_close(got, expected(case, comm, STEPS), f"{case.id} zeroed in turn by {', '.join(ORDER)}")
    if case.id in ROUNDS and case.id not in ("local-sgd", "easgd"):
        assert [i.global_samples for i in infos] == [BATCH * comm.size] * STEPS
    assert all(i.local_samples == BATCH for i in infos)


def test_every_registered_solver_has_a_case():
    import mpisolve

    assert {c.solver for c in BY_ID.values()} == set(mpisolve.solver_names())


@pytest.mark.parametrize("solver_name", ["allreduce", "kfac"])
def test_the_documented_way_keeps_backward_writing_into_the_buckets(solver_name):
    """``solver.zero_grad()`` zeroes in place: every ``.grad`` stays a view of its bucket, so
    backward accumulates straight into the memory MPI reduces (no copy on the hot path). One
    rank alone has no buckets (tests/comm/test_buckets.py): forced staging keeps them here."""
    import mpisolve

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    comm = mpisolve.Communicator(stage_all=True)
    with mpisolve.make_solver(solver_name, model, torch.optim.SGD(model.parameters(), lr=0.1), comm) as solver:
        buckets = solver.grads.buckets  # type: ignore[attr-defined]
        spans = [(b.buffer.flat.data_ptr(), b.buffer.flat.data_ptr() + b.buffer.flat.nbytes) for b in buckets]
        for _ in range(3):
            solver.zero_grad()
            grads = [p.grad for p in model.parameters()]
            assert all(g is not None and float(g.abs().sum()) == 0.0 for g in grads)
            loss_fn(model(torch.randn(5, 4)), torch.randint(0, 2, (5,))).backward()
            assert all(p.grad is g for p, g in zip(model.parameters(), grads))  # the same tensors: written in place
            assert all(any(lo <= g.data_ptr() < hi for lo, hi in spans) for g in grads)  # type: ignore[union-attr]
            solver.step()
