"""Gradient accumulation: micro-batches under ``no_sync()``, then one step, equal one step
on their concatenated samples (each micro-batch's loss divided by their number, as with
DDP). A second backward outside ``no_sync()`` either works the same or is refused with a
clear error on every rank, never a silently different update. K-FAC's factors are
accumulated over the micro-batches too: it trains as K-FAC in one process on the ranks'
micro-batches concatenated (before the fix it refused ``no_sync``).

Before the fix, two backward passes before a step raced the bucket allreduce already in
flight and applied a different update on every rank.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
from mpi4py import MPI

from mpisolve.comm.communicator import Communicator

from .conftest import TIMEOUT_S
from .harness import (
    BATCH,
    BUCKETS,
    BY_ID,
    all_raised,
    assert_close,
    cases,
    expected,
    final_params,
    global_batch,
    loss_fn,
    make_model,
    run,
    settle,
    shard,
)

MICRO = 2  # micro-batches per step
STEPS = 2


def accumulate(use_no_sync: bool):
    """A step function: the rank's shard in MICRO micro-batches, the last outside no_sync()."""

    def step(solver, model, optimizer, k):
        x, y = shard(global_batch(k, solver.comm.size), solver.comm.rank)
        solver.zero_grad()
        size = BATCH // MICRO
        for i in range(MICRO):
            last = i == MICRO - 1
            with solver.no_sync() if use_no_sync and not last else nullcontext():
                xs, ys = x[i * size : (i + 1) * size], y[i * size : (i + 1) * size]
                (loss_fn(model(xs), ys) / MICRO).backward()
        info = solver.step()
        assert info.local_samples == BATCH
        settle(solver)

    return step


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_no_sync_accumulation_equals_one_step_on_the_concatenated_batch(comm, case):
    got = run(case, comm, STEPS, accumulate(use_no_sync=True))
    if case.id == "kfac":
        return  # below, against K-FAC in one process
    assert_close(got, expected(case, comm, STEPS), f"{case.id} with no_sync")


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("packed", [False, True], ids=["full", "triangles"])
def test_kfac_accumulates_its_factors_as_one_process_on_the_concatenated_batch(comm, packed):
    """Every micro-batch's factors, one inversion per step: K-FAC at every rank equals K-FAC in
    one process stepping on the whole global batch at once (every step here inverts)."""
    case = BY_ID["kfac"]
    got = run(case, comm, STEPS, accumulate(use_no_sync=True), pack_triangles=packed)

    def whole_batch(solver, model, optimizer, k):
        x, y = global_batch(k, comm.size)  # every rank's samples
        solver.zero_grad()
        loss_fn(model(x), y).backward()
        solver.step()

    alone = Communicator(MPI.COMM_SELF, timeout_s=TIMEOUT_S)
    assert_close(got, run(case, alone, STEPS, whole_batch, pack_triangles=packed), "kfac with no_sync")


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_second_backward_without_no_sync_works_or_is_refused_on_every_rank(comm, case):
    if case.id not in BUCKETS:
        got = run(case, comm, STEPS, accumulate(use_no_sync=False))
        assert_close(got, expected(case, comm, STEPS), f"{case.id}, two backward passes")
        return
    import torch

    model = make_model()
    solver = case.build(model, torch.optim.SGD(model.parameters(), lr=0.1), comm)
    error = None
    try:
        accumulate(use_no_sync=False)(solver, model, None, 0)
    except RuntimeError as err:
        error = err
    final_params(solver, model)  # close() completes what the refused step left in flight
    messages = all_raised(comm, error)
    want = "run every backward but the last inside `with solver.no_sync():`"
    assert all(m is not None and want in m for m in messages), messages


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("case", cases(BUCKETS[:3]), ids=lambda c: c.id)
def test_no_sync_after_a_synchronizing_backward_is_refused_before_it_runs(comm, case):
    import torch

    model = make_model()
    solver = case.build(model, torch.optim.SGD(model.parameters(), lr=0.1), comm)
    x, y = shard(global_batch(0, comm.size), comm.rank)
    loss_fn(model(x), y).backward()
    error = None
    try:
        solver.no_sync()
    except RuntimeError as err:
        error = err
    solver.step()  # the first backward's step is intact
    final_params(solver, model)
    assert all(m is not None and "no_sync() entered after a backward()" in m for m in all_raised(comm, error))
