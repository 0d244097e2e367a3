"""What the conformance tests share: every registered solver in a fast, deterministic setting,
a tiny model and data, the documented loop, and the one-process oracle.

Each case is a registered solver with options that keep it fast and deterministic here:
K-FAC without measurements, ABS-SGD polled and settled after every step (each round then
holds one micro-batch per rank), the asynchronous solvers with an exchange period longer
than the tests (their steps are local; their exchanges are tested in tests/solvers).
``adasum`` runs in both modes.

:func:`oracle` computes, in one process from every rank's samples, what each solver's
rule gives (SGD on the mean gradient; Adasum by the numpy reference; ABS-SGD's one-round
delay; local SGD's averages; EASGD's elastic exchanges; the asynchronous solvers' local
steps). K-FAC's rule is not re-implemented: its oracle is the same solver driven by
the documented loop (:func:`reference`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import mpisolve
from mpisolve.comm.communicator import Communicator
from mpisolve.solvers.base import Solver
from tests import adasum_reference

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
    Case("abs-sgd", "abs-sgd", {"progress": "none", "micro_batch": "fixed", "weight_prediction": 0.0}),
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
#: Only local steps within a test: each rank's own model is the result (before close).
LOCAL = TOLERANT[1:]


def cases(ids: tuple[str, ...] | None = None) -> list[Case]:
    return [c for c in CASES if ids is None or c.id in ids]


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def prepare(model: nn.Module, rank: int, step: int) -> None:
    """Models whose forward depends on the rank and step (a branch) say so by a ``prepare`` method."""
    hook = getattr(model, "prepare", None)
    if hook is not None:
        hook(rank, step)


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
    """The result after ``close`` (the center for EASGD), or, for the asynchronous cases
    (whose center the tests never move), this rank's own model before it."""
    mine = flat(model)
    solver.close()
    return mine if solver.name in LOCAL else flat(model)


Step = Callable[[Solver, nn.Module, torch.optim.Optimizer, int], None]


def documented_step(solver: Solver, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """One step of the documented loop on this rank's shard of ``step``'s global batch."""
    x, y = shard(global_batch(step, solver.comm.size), solver.comm.rank)
    solver.zero_grad()
    prepare(model, solver.comm.rank, step)
    loss_fn(model(x), y).backward()
    solver.step()
    settle(solver)


def run(
    case: Case,
    comm: Communicator,
    steps: int,
    step_fn: Step = documented_step,
    build: Callable[[], nn.Module] = make_model,
    **options: Any,
) -> torch.Tensor:
    """Train a fresh ``build()`` with ``case`` for ``steps`` steps of ``step_fn``; the final parameters."""
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    solver = case.build(model, optimizer, comm, **options)
    for step in range(steps):
        step_fn(solver, model, optimizer, step)
    return final_params(solver, model)


_REFERENCE: dict[tuple[str, int, int, str], torch.Tensor] = {}


def reference(case: Case, comm: Communicator, steps: int, build: Callable[[], nn.Module] = make_model) -> torch.Tensor:
    """The same solver driven by the documented loop (computed once per case, world size and model)."""
    key = (case.id, comm.size, steps, build.__name__)
    if key not in _REFERENCE:
        _REFERENCE[key] = run(case, comm, steps, build=build)
    return _REFERENCE[key]


Grads = list[torch.Tensor]
Transform = Callable[[Grads], Grads]


class _Gradients:
    """Gradients of the loss at given parameters on given samples, in one process."""

    def __init__(self, build: Callable[[], nn.Module]) -> None:
        self.model = build()

    def __call__(self, params: Grads, x: torch.Tensor, y: torch.Tensor, autocast: bool, rank: int, step: int) -> Grads:
        """Zeros for a parameter without a gradient (frozen, or not used by this forward)."""
        with torch.no_grad():
            for p, v in zip(self.model.parameters(), params):
                p.copy_(v)
        self.model.zero_grad(set_to_none=True)
        prepare(self.model, rank, step)
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext():
            loss = loss_fn(self.model(x), y)
        loss.backward()
        return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in self.model.parameters()]


def _sgd(params: Grads, grads: Grads) -> Grads:
    return [p.add(g, alpha=-LR) for p, g in zip(params, grads)]


def _mean(operands: list[Grads]) -> Grads:
    """The mean over ranks, summed in float32 at least (as the wire is) and cast back."""
    return [(sum(t.float() for t in ts) / len(ts)).to(ts[0].dtype) for ts in zip(*operands)]


def _adasum(operands: list[Grads]) -> Grads:
    """Adasum per tensor over the ranks, in mpisolve's order (the numpy reference)."""
    return [
        torch.from_numpy(adasum_reference.tree([t.double().numpy() for t in ts])).to(ts[0].dtype).view(ts[0].shape)
        for ts in zip(*operands)
    ]


def oracle(
    case: Case,
    comm: Communicator,
    steps: int,
    *,
    transform: Transform | None = None,
    autocast: bool = False,
    skipped: Callable[[int, int], bool] = lambda rank, step: False,
    present: Callable[[int, int], bool] | None = None,
    build: Callable[[], nn.Module] = make_model,
) -> torch.Tensor:
    """What ``case``'s rule gives after ``steps`` steps of the documented loop, computed in one
    process from every rank's samples (this rank's result for the asynchronous cases).

    ``transform``: applied to what ``synchronize()`` leaves in ``p.grad`` (the reduced
    gradient, or each rank's own for the solvers that step on local gradients).
    ``skipped(rank, step)``: that rank's gradient is not finite at that step (the
    synchronous rules then skip the step on every rank; the local ones on that rank).
    ``present(rank, step)``: under ``join()``, whether that rank still has a batch at that
    step (an absent rank contributes nothing: zeros to Adasum, no model to an average,
    no pull to EASGD's center; ``steps`` is then the longest loop). ``build``: the model;
    its frozen parameters stay as they are.
    """
    if case.id == "kfac":
        raise ValueError("K-FAC's oracle is the documented loop: use reference()")
    size = comm.size
    grad = _Gradients(build)
    T = transform if transform is not None else (lambda g: g)
    start = [p.detach().clone() for p in build().parameters()]
    models = [list(start) for _ in range(size)]  # every rank's own model (local rules)
    mu = case.options.get("momentum", {"async-msgd": 0.9, "async-measgd": 0.99}.get(case.id, 0.0))
    velocity = [[torch.zeros_like(p) for p in start] for _ in range(size)]  # Nesterov, around the step
    params = list(start)  # the one model (synchronous rules), or EASGD's center
    pending: list[tuple[Grads, int]] | None = None  # ABS-SGD's round in flight
    tau = case.options.get("tau", 0)
    alpha = 0.9 / size
    here = present if present is not None else (lambda rank, step: True)
    moved = [False] * size  # took a local step since the last average or exchange

    def zeros() -> Grads:
        return [torch.zeros_like(p) for p in start]

    for step in range(steps):
        batch = global_batch(step, size)

        def local(rank: int, at: Grads, batch: tuple[torch.Tensor, torch.Tensor] = batch, step: int = step) -> Grads:
            return grad(at, *shard(batch, rank), autocast, rank, step)

        any_skipped = any(skipped(r, step) for r in range(size))
        ranks = [r for r in range(size) if here(r, step)]
        if case.id in SGD_RULE:
            if not any_skipped:
                params = _sgd(params, T(_mean([local(r, params) for r in ranks])))
        elif case.id == "adasum-gradient":
            if not any_skipped:
                params = _sgd(params, T(_adasum([local(r, params) if r in ranks else zeros() for r in range(size)])))
        elif case.id == "adasum":
            if not any_skipped:
                deltas = [[-LR * g for g in T(local(r, params))] if r in ranks else zeros() for r in range(size)]
                params = [p + d for p, d in zip(params, _adasum(deltas))]
        elif case.id == "abs-sgd":
            this_round = [(T(local(r, params)), BATCH) for r in range(size) if not skipped(r, step)]
            if pending is not None and pending:
                total = sum(n for _, n in pending)
                params = _sgd(params, [sum(g[i] * n for g, n in pending) / total for i in range(len(params))])
            pending = this_round
        else:  # local steps, then an average or an elastic exchange every tau
            for r in ranks:
                if not skipped(r, step):
                    moved[r] = True
                    stepped = _sgd(models[r], T(local(r, models[r])))
                    for i, (x, v) in enumerate(zip(models[r], velocity[r])):
                        v.mul_(mu).add_(stepped[i] - x)
                        stepped[i] = stepped[i] + mu * v
                    models[r] = stepped
            if (step + 1) % tau == 0:  # the ranks in their loops, and those that moved since the last
                contribute = [moved[r] or here(r, step) for r in range(size)]
                models, params = _meet(case.id, models, params, contribute, alpha)
                moved = [False] * size
            elif step == steps - 1 and present is not None:  # join: one more round, after every loop
                models, params = _meet(case.id, models, params, moved, alpha)
    if case.id == "local-sgd" or case.id in LOCAL:
        params = models[comm.rank]
    return torch.cat([p.double().reshape(-1) for p in params])


def _meet(rule: str, models: list[Grads], center: Grads, moved: list[bool], alpha: float) -> tuple[list[Grads], Grads]:
    """Local SGD's average or EASGD's exchange, among the ranks that moved since the last one
    (every rank, but under join())."""
    movers = [m for m, mv in zip(models, moved) if mv]
    if rule == "local-sgd":
        return ([_mean(movers)] * len(models) if movers else models), center
    if rule != "easgd":
        return models, center
    diffs = [
        [x - c for x, c in zip(m, center)] if mv else [torch.zeros_like(c) for c in center]
        for m, mv in zip(models, moved)
    ]
    models = [[x - alpha * d for x, d in zip(m, ds)] for m, ds in zip(models, diffs)]
    return models, [c + alpha * sum(ds[i] for ds in diffs) for i, c in enumerate(center)]


def expected(case: Case, comm: Communicator, steps: int, **kwargs: Any) -> torch.Tensor:
    """The oracle for ``case``: :func:`oracle`, or the documented loop for K-FAC."""
    if case.id == "kfac":
        return reference(case, comm, steps, kwargs.get("build", make_model))
    return oracle(case, comm, steps, **kwargs)


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def all_ranks_equal(comm: Communicator, tensor: torch.Tensor) -> bool:
    gathered = comm.allgather_object(tensor.tolist())
    return all(g == gathered[0] for g in gathered)


def all_raised(comm: Communicator, error: BaseException | None) -> list[str | None]:
    """Every rank's error message (None: none), so that each rank can check all of them."""
    return comm.allgather_object(None if error is None else f"{type(error).__name__}: {error}")
