"""What the conformance tests share: every registered solver in a fast, deterministic setting,
a tiny model and data, the documented loop, and the one-process oracle.

Each case is a registered solver with options that keep it fast and deterministic here:
K-FAC without measurements, ABS-SGD polled and settled after every step (each round then
holds one micro-batch per rank), the asynchronous solvers with an exchange period longer
than the tests (their steps are local, so the documented loop is a deterministic oracle;
their exchanges are tested in tests/solvers). ``adasum`` runs in both modes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import mpisolve
from mpisolve.comm.communicator import Communicator
from mpisolve.solvers.base import Solver

#: Samples per rank per step.
BATCH = 4
LR = 0.1
IN, HIDDEN, OUT = 6, 8, 3


@dataclass(frozen=True)
class Case:
    """A registered solver under a name of its own, with the options the tests use."""

    id: str
    solver: str
    options: dict[str, Any] = field(default_factory=dict)

    def build(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Communicator, **extra: Any) -> Solver:
        options = dict(self.options)
        if self.solver == "lb-bsp":
            options["speeds"] = ",".join(["1"] * comm.size)
        options.update(extra)
        return mpisolve.make_solver(self.solver, model, optimizer, comm=comm, **options)


ASYNC_LOCAL = {"tau": 1000, "progress": "none"}
CASES = [
    Case("allreduce", "allreduce"),
    Case("adasum", "adasum"),
    Case("adasum-gradient", "adasum", {"mode": "gradient"}),
    Case("lb-bsp", "lb-bsp"),
    Case(
        "kfac",
        "kfac",
        {
            "fusion": "none",
            "replicate": "never",
            "pack_triangles": False,
            "factor_update_steps": 1,
            "inv_update_steps": 1,
            "damping": 0.01,
        },
    ),
    Case("abs-sgd", "abs-sgd", {"progress": "poll", "micro_batch": "fixed", "weight_prediction": 0.0}),
    Case("local-sgd", "local-sgd", {"tau": 2}),
    Case("easgd", "easgd", {"tau": 2}),
    Case("async-sgd", "async-sgd", ASYNC_LOCAL),
    Case("async-msgd", "async-msgd", ASYNC_LOCAL),
    Case("hogwild-sgd", "hogwild-sgd", ASYNC_LOCAL),
    Case("async-easgd", "async-easgd", ASYNC_LOCAL),
    Case("async-measgd", "async-measgd", ASYNC_LOCAL),
    Case("ea-wild", "ea-wild", ASYNC_LOCAL),
]
BY_ID = {case.id: case for case in CASES}
#: Their update is SGD's on the global batch's mean gradient: a one-process oracle applies.
SGD_RULE = ("allreduce", "lb-bsp")
#: Gradients reduced in fused buckets while backward runs.
BUCKETS = ("allreduce", "adasum-gradient", "lb-bsp", "kfac")
#: Each step (average, exchange) is a collective round: join() shadows, close() compares.
ROUNDS = ("allreduce", "adasum", "adasum-gradient", "lb-bsp", "kfac", "local-sgd", "easgd")
#: Ranks may stop apart with no help.
TOLERANT = ("abs-sgd", "async-sgd", "async-msgd", "hogwild-sgd", "async-easgd", "async-measgd", "ea-wild")


def cases(ids: tuple[str, ...] | None = None) -> list[Case]:
    return [c for c in CASES if ids is None or c.id in ids]


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def global_batch(step: int, size: int, per_rank: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's samples for all ``size`` ranks, rank r's at rows [r * per_rank, (r + 1) * per_rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(per_rank * size, IN, generator=g)
    y = torch.randint(0, OUT, (per_rank * size,), generator=g)
    return x, y


def shard(batch: tuple[torch.Tensor, torch.Tensor], rank: int, per_rank: int = BATCH) -> tuple[torch.Tensor, ...]:
    return tuple(t[rank * per_rank : (rank + 1) * per_rank] for t in batch)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def settle(solver: Solver) -> None:
    """Make a timing-dependent solver deterministic: ABS-SGD's round completes before the next step."""
    if solver.name == "abs-sgd":
        solver._complete_in_flight("conformance test")  # type: ignore[attr-defined]


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])


def final_params(solver: Solver, model: nn.Module) -> torch.Tensor:
    """The result after ``close`` (the center for the elastic solvers)."""
    solver.close()
    return flat(model)


Step = Callable[[Solver, nn.Module, torch.optim.Optimizer, int], None]


def documented_step(solver: Solver, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """One step of the documented loop on this rank's shard of ``step``'s global batch."""
    x, y = shard(global_batch(step, solver.comm.size), solver.comm.rank)
    solver.zero_grad()
    loss_fn(model(x), y).backward()
    solver.step()
    settle(solver)


def run(case: Case, comm: Communicator, steps: int, step_fn: Step = documented_step, **options: Any) -> torch.Tensor:
    """Train a fresh model with ``case`` for ``steps`` steps of ``step_fn``; the final parameters."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    solver = case.build(model, optimizer, comm, **options)
    for step in range(steps):
        step_fn(solver, model, optimizer, step)
    return final_params(solver, model)


_REFERENCE: dict[tuple[str, int, int], torch.Tensor] = {}


def reference(case: Case, comm: Communicator, steps: int) -> torch.Tensor:
    """The same solver driven by the documented loop (computed once per case and world size)."""
    key = (case.id, comm.size, steps)
    if key not in _REFERENCE:
        _REFERENCE[key] = run(case, comm, steps)
    return _REFERENCE[key]


def oracle(
    size: int, steps: int, transform: Callable[[nn.Module, torch.optim.Optimizer], None] | None = None
) -> torch.Tensor:
    """One process, SGD on each step's global batch (mean loss); ``transform`` acts between
    backward and the optimizer's step (clipping)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = global_batch(step, size)
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        if transform is not None:
            transform(model, optimizer)
        optimizer.step()
    return flat(model)


def expected(case: Case, comm: Communicator, steps: int) -> torch.Tensor:
    """The oracle for ``case``: one process where SGD's rule applies, else the documented loop."""
    return oracle(comm.size, steps) if case.id in SGD_RULE else reference(case, comm, steps)


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def all_ranks_equal(comm: Communicator, tensor: torch.Tensor) -> bool:
    gathered = comm.allgather_object(tensor.tolist())
    return all(g == gathered[0] for g in gathered)


def all_raised(comm: Communicator, error: BaseException | None) -> list[str | None]:
    """Every rank's error message (None: none), so that each rank can check all of them."""
    return comm.allgather_object(None if error is None else f"{type(error).__name__}: {error}")
