"""``join()`` around a real loop: a GradScaler with bfloat16 autocast, clipping after
``synchronize()``, a learning-rate scheduler stepped every step and Adam. The rank that runs
out of data does none of that in the others' remaining steps; ``join()`` still ends with equal
models and optimizer states on every rank (the last rank to join gives its own, as DDP's
``Join`` gives its model), and tells which rank that was.

The oracle for the solvers whose rule is SGD's on the mean gradient is DistributedDataParallel
itself on gloo, in the same processes, under ``Join(divide_by_initial_world_size=False)``
(the mean over the ranks still in their loops, as mpisolve's).

Before the fix the joined rank shadowed the others' steps with a plain ``step()``: it applied
the scaled gradients unscaled-for, unclipped, at its own learning rate, and its model and
Adam state ended different from the others'.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join

from .harness import (
    ROUNDS,
    SGD_RULE,
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
MAX_NORM = 0.1


def batches(rank: int) -> int:
    """Rank r has STEPS - r batches: rank 0 joins last."""
    return max(1, STEPS - rank)


@pytest.fixture(scope="module")
def gloo(comm) -> Iterator[None]:
    """torch.distributed on gloo over the same ranks (for DDP, the oracle)."""
    address = comm.bcast_object(socket.gethostname() if comm.rank == 0 else None)
    port = comm.bcast_object(_free_port() if comm.rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=comm.rank, world_size=comm.size)
    yield
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    size: int,
    joining: AbstractContextManager[object],
    forward: Callable[[torch.Tensor], torch.Tensor],
    finish: Callable[[torch.amp.GradScaler], None],
    step: Callable[[torch.amp.GradScaler], None],
) -> torch.amp.GradScaler:
    """The real loop: bfloat16 autocast under a GradScaler, clipping, a per-step scheduler.
    The last step (rank 0's alone) overflows: the scaler skips it and backs off."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with joining:
        for k in range(batches(rank)):
            x, y = shard(global_batch(k, size), rank)
            if k == STEPS - 1:
                x = x * float("inf")
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(forward(x), y)
            scaler.scale(loss).backward()
            finish(scaler)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            step(scaler)
            scaler.update()
            scheduler.step()
    return scaler


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.05)


def optimizer_state(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Every tensor and number of the optimizer's state and its learning rates, flat."""
    state = optimizer.state_dict()
    values = [float(group["lr"]) for group in state["param_groups"]]
    for key in sorted(state["state"]):
        for name in sorted(state["state"][key]):
            values += torch.as_tensor(state["state"][key][name]).double().reshape(-1).tolist()
    return torch.tensor(values, dtype=torch.float64)


def with_ddp(comm) -> torch.Tensor:
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = adam(model)

    def unscale(scaler: torch.amp.GradScaler) -> None:
        scaler.unscale_(optimizer)

    def step(scaler: torch.amp.GradScaler) -> None:
        scaler.step(optimizer)

    joining = Join([ddp], divide_by_initial_world_size=False)
    loop(model, optimizer, comm.rank, comm.size, joining, ddp, unscale, step)
    return flat(model)


def under_join(comm, case, leaving: AbstractContextManager[object]):
    """The loop with ``case``'s solver inside ``solver.join()``, ``leaving`` around each rank's own
    loop: (model, optimizer, solver, the join's result, the loop's scaler)."""
    model = make_model()
    optimizer = adam(model)
    solver = case.build(model, optimizer, comm)

    def synchronize(scaler: torch.amp.GradScaler) -> None:
        solver.synchronize(scaler=scaler)

    def step(scaler: torch.amp.GradScaler) -> None:
        solver.step(scaler=scaler)

    with solver.join() as joined:
        scaler = loop(model, optimizer, comm.rank, comm.size, leaving, model, synchronize, step)
    return model, optimizer, solver, joined, scaler


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.filterwarnings("ignore:mpisolve kfac.*non-finite batch factors")  # the overflowing step's input
@pytest.mark.parametrize("case", cases(ROUNDS), ids=lambda c: c.id)
def test_join_ends_with_the_last_ranks_model_and_optimizer_state_whatever_the_loop_does(comm, gloo, case):
    model, optimizer, solver, joined, scaler = under_join(comm, case, nullcontext())
    got = flat(model)
    state = optimizer_state(optimizer)
    solver.close()
    assert joined.last_rank == 0  # the rank with the most batches
    if case.id in ("local-sgd", "easgd"):  # local steps: each rank's scaler is its own, as its step
        assert scaler.get_scale() == (512.0 if comm.rank == 0 else 1024.0)
    else:  # the joined ranks' scalers were updated as rank 0's loop updated its own (a skip, a back-off)
        assert all_ranks_equal(comm, torch.tensor(list(scaler.state_dict().values()), dtype=torch.float64))
        assert scaler.get_scale() == 512.0
    if case.id == "easgd":  # its workers differ by design: the result is the center, equal after close
        assert all_ranks_equal(comm, flat(model))
        return
    assert all_ranks_equal(comm, got), f"{case.id}: the ranks' models differ after join()"
    assert all_ranks_equal(comm, state), f"{case.id}: the ranks' optimizer states differ after join()"
    if case.id in SGD_RULE:
        assert_close(got, with_ddp(comm), f"{case.id} under join() against DDP's Join")


@contextmanager
def leaving_late(rank: int) -> Iterator[None]:
    """A loop whose rank (all but rank 0) leaves it half a second after its last step."""
    yield
    if rank > 0:
        time.sleep(0.5)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.filterwarnings("ignore:mpisolve kfac.*non-finite batch factors")  # the overflowing step's input
@pytest.mark.parametrize("case", cases(ROUNDS), ids=lambda c: c.id)
def test_a_rank_that_joins_late_shadows_steps_begun_with_synchronize(comm, case):
    """Rank 0 is inside ``synchronize()`` when the others, out of data, begin shadowing its step
    with ``step()`` alone: the step's sums complete in the same order on every rank (K-FAC's
    factors before the gradients; before the fix the bandwidth path's rounds waited on each
    other until the watchdog)."""
    model, _, solver, joined, _ = under_join(comm, case, leaving_late(comm.rank))
    solver.close()
    assert joined.last_rank == 0
    if case.id != "easgd":  # its workers differ by design
        assert all_ranks_equal(comm, flat(model)), f"{case.id}: the ranks' models differ after join()"
