"""Uneven inputs. With ``join()`` every rank leaves its loop, the models end equal, and each
update counts only the ranks still in their loops (rank r has ``STEPS - r`` batches here).
Without it, a rank that stops early gets every rank a clear error within a poll of the
others' waits, not the watchdog; the solvers that tolerate stopping apart need neither.

Before the fix, the ranks with more batches waited in their next step until the watchdog.
"""

from __future__ import annotations

import pytest
import torch

from mpisolve.comm.communicator import Communicator
from mpisolve.errors import PeerClosed, UnevenSteps

from .conftest import TIMEOUT_S
from .harness import (
    BATCH,
    BUCKETS,
    LOCAL,
    LR,
    ROUNDS,
    Case,
    all_raised,
    all_ranks_equal,
    assert_close,
    cases,
    documented_step,
    final_params,
    global_batch,
    loss_fn,
    make_model,
    oracle,
    run,
    shard,
)

STEPS = 3


def batches(rank: int) -> int:
    return max(1, STEPS - rank)


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_join_lets_every_rank_finish_and_counts_the_samples_present(comm, case):
    model = make_model()
    solver = case.build(model, torch.optim.SGD(model.parameters(), lr=LR), comm)
    infos = []
    with solver.join():
        for k in range(batches(comm.rank)):
            x, y = shard(global_batch(k, comm.size), comm.rank)
            solver.zero_grad()
            loss_fn(model(x), y).backward()
            infos.append(solver.step())
    got = final_params(solver, model)
    if case.id in BUCKETS:
        present = [sum(k < batches(r) for r in range(comm.size)) for k in range(len(infos))]
        assert [i.global_samples for i in infos] == [BATCH * n for n in present]
    if case.id not in LOCAL:
        assert all_ranks_equal(comm, got)
    if case.id in ("kfac", "abs-sgd"):
        return  # K-FAC's rule is not re-implemented here; ABS-SGD's rounds depend on timing
    want = oracle(case, comm, STEPS, present=lambda rank, k: k < batches(rank))
    assert_close(got, want, f"{case.id} under join()")


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("case", cases(ROUNDS), ids=lambda c: c.id)
def test_without_join_a_rank_that_stops_early_gets_every_rank_an_error(comm, case):
    stop_early(comm, case)


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@pytest.mark.ranks(2, 3, 4)
@pytest.mark.parametrize("case", cases(("allreduce", "lb-bsp", "kfac")), ids=lambda c: c.id)
def test_without_join_on_mpis_path_where_ranks_share_cores_every_rank_gets_an_error(case):
    """The same on MPI's path (no node-shared memory: the path of small buckets across nodes) where
    ranks yield their cores, at 2, 3, 4 ranks and on the emulated cluster."""
    comm = Communicator(timeout_s=TIMEOUT_S, wait="yield", node_shm=False)
    stop_early(comm, case)
    comm.free()


def stop_early(comm: Communicator, case: Case) -> None:
    """The last rank stops after 2 steps, the others after 4, none joined: every rank gets an error."""
    model = make_model()
    solver = case.build(model, torch.optim.SGD(model.parameters(), lr=LR), comm)
    steps = 2 if comm.rank == comm.size - 1 else 4  # local-sgd and easgd meet every 2 steps
    error: Exception | None = None
    try:
        for k in range(steps):
            documented_step(solver, model, None, k)
    except PeerClosed as err:
        error = err
    try:
        solver.close()
    except UnevenSteps as err:
        error = error or err
    messages = all_raised(comm, error)
    assert all(m is not None and "`with solver.join():`" in m for m in messages), messages
    assert any(m.startswith("UnevenSteps") for m in messages) and any(m.startswith("PeerClosed") for m in messages)
    # Nothing was left behind on the communicator: a new solver trains as the documented loop.
    assert_close(run(case, comm, 1), oracle(case, comm, 1) if case.id != "kfac" else run(case, comm, 1), case.id)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("case", cases(BUCKETS + ("adasum",)), ids=lambda c: c.id)
def test_close_after_a_started_step_completes_it_first(comm, case):
    """Every rank ran backward (collectives started in its hooks) and closes without a step:
    close() completes them before freeing (it freed active requests before the fix)."""
    model = make_model()
    solver = case.build(model, torch.optim.SGD(model.parameters(), lr=LR), comm)
    x, y = shard(global_batch(0, comm.size), comm.rank)
    if comm.rank == 0:
        x = x[:0]  # rank 0's forward saw no sample: only the hooks of the others started anything
    loss_fn(model(x), y[: len(x)]).backward() if len(x) else None
    solver.close()
    assert_close(run(case, comm, 1), oracle(case, comm, 1) if case.id != "kfac" else run(case, comm, 1), case.id)
