"""Only training forwards count. Rank 0 evaluates between the training steps, before the
training forward, between backward and ``step()``, and after it, in each of the ways users
do: under ``torch.no_grad()``, under ``torch.inference_mode()``, after ``model.eval()`` with
autograd on (Horovod's MNIST example), and inside ``solver.evaluating()`` in training mode
with autograd on. None of it is a training sample or a K-FAC factor: every solver trains as
the documented loop does, and every step reports the samples trained on.

Before the fix the last two counted: ``allreduce``'s ``global_samples`` grew with every
evaluation, ``lb-bsp``'s update was weighted by them, and K-FAC raised "computed twice".
"""

from __future__ import annotations

import pytest
import torch

from mpisolve.solvers.base import Solver

from .harness import BATCH, assert_close, cases, expected, global_batch, loss_fn, prepare, run, settle, shard

STEPS = 3
WAYS = ("no_grad", "inference_mode", "eval", "evaluating")
#: Every step is an update on every rank's samples.
SYNCHRONOUS = ("allreduce", "adasum", "adasum-gradient", "lb-bsp", "kfac")


def evaluate(solver: Solver, model: torch.nn.Module, way: str) -> None:
    """One evaluation forward of rank 0's, on a batch of its own size."""
    x, _ = shard(global_batch(99, solver.comm.size), 0, per_rank=2 * BATCH)
    if way == "evaluating":
        with solver.evaluating() as m:
            m(x)
        return
    if way == "eval":
        model.eval()
        model(x)
        model.train()
        return
    with torch.no_grad() if way == "no_grad" else torch.inference_mode():
        model(x)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_evaluation_forwards_count_no_samples_and_no_factors(comm, case, way):
    infos = []

    def step(solver, model, optimizer, k):
        evaluating = comm.rank == 0
        x, y = shard(global_batch(k, comm.size), comm.rank)
        solver.zero_grad()
        if evaluating:
            evaluate(solver, model, way)
        prepare(model, comm.rank, k)
        loss_fn(model(x), y).backward()
        if evaluating:
            evaluate(solver, model, way)
        infos.append(solver.step())
        settle(solver)
        if evaluating:
            evaluate(solver, model, way)

    got = run(case, comm, STEPS, step)
    assert [i.local_samples for i in infos] == [BATCH] * STEPS
    if case.id in SYNCHRONOUS:
        assert [i.global_samples for i in infos] == [BATCH * comm.size] * STEPS
    assert_close(got, expected(case, comm, STEPS), f"{case.id}, rank 0 evaluating ({way})")
