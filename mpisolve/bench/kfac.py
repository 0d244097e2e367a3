"""``bench kfac``: a training iteration of each K-FAC variant, and of plain allreduce SGD.

Every K-FAC iteration updates the factors and the inverses (``factor_update_steps =
inv_update_steps = 1``): the worst case, where the variants differ most. Per variant
(``variants``; with ``--grad-worker-fraction`` other than 1, ``variants["spd-kfac@0.5"]``
and so on): ``iter_s`` (median seconds of forward, backward and ``step()``, the slowest
rank's), ``breakdown`` (seconds per iteration of each phase, the largest over ranks:
factor compute in the hooks and the running-average update, factor communication waited
for, inversion, waiting for other ranks' inversions (``inverse_wait``) and moving their
results (``inverse_transfer``), preconditioning, and the same two for preconditioned
gradients from other ranks), the placement's ``inversion_load_max_over_mean`` (its cost
unit: inversions plus preconditioning) and the measured ``inversion_s_max_over_mean``,
both over the ``inverting_ranks`` (all ranks, unless a node runs more ranks than it has
cores), and ``predicted_over_measured`` per rank (the placement's load, in seconds with
``--placement-cost measured``, over the rank's measured inversion plus preconditioning).
Top level: ``sgd_iter_s`` (the allreduce solver on the same model and batch),
``spd_over_d`` (spd-kfac iter_s / d-kfac iter_s, at the first fraction),
``inversion_load_max_over_mean`` (spd-kfac's), ``ranks``. ``--device cuda`` runs the
model on this rank's GPU (factors, inversions through CuPy, MPI staged or direct).
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..errors import InputError
from ..solvers import Solver, make_solver
from ..solvers.kfac.placement import EVERY_RANK, max_over_mean
from ..solvers.kfac.solver import PHASES, VARIANTS, KFACSolver
from ..train.models import MODELS, build_model
from . import add_device_argument, bench_device, median_seconds
from .allreduce import MODEL_INPUTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet18")
    parser.add_argument("--batch", type=int, default=4, help="examples per rank per iteration")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated K-FAC variants to time")
    parser.add_argument("--method", choices=("inverse", "eigen"), default="inverse")
    parser.add_argument("--profile-steps", type=int, default=2, help="spd-kfac's fusion_profile_steps")
    add_device_argument(parser)
    parser.add_argument(
        "--grad-worker-fraction",
        default="1",
        help="comma-separated grad_worker_fraction values to time each variant at",
    )
    parser.add_argument("--placement-cost", choices=("flops", "measured"), default="flops")
    parser.set_defaults(repeats=3, warmup=1)  # a ResNet-18 K-FAC iteration takes seconds on a CPU


def run(args: argparse.Namespace, comm: Communicator) -> dict[str, Any]:
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:
        raise InputError(f"--variants takes a comma-separated subset of {', '.join(VARIANTS)}; got {args.variants!r}")
    if args.batch < 1 or args.profile_steps < 1:
        raise InputError("--batch and --profile-steps must be >= 1")
    in_shape, classes = MODEL_INPUTS[args.model]
    device = bench_device(args, comm)
    generator = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(args.batch, *in_shape, generator=generator).to(device)
    y = torch.randint(0, classes, (args.batch,), generator=generator).to(device)
    result: dict[str, Any] = {
        "model": args.model,
        "device": str(device),
        "batch_per_rank": args.batch,
        "method": args.method,
        "ranks": comm.size,
        "repeats": args.repeats,
        "variants": {},
    }
    try:
        fractions = [float(f) for f in args.grad_worker_fraction.split(",") if f]
    except ValueError:
        given = args.grad_worker_fraction
        raise InputError(f"--grad-worker-fraction takes comma-separated numbers, got {given!r}") from None
    if not fractions:
        raise InputError("--grad-worker-fraction needs at least one value")
    for fraction in fractions:
        for variant in variants:
            options = dict(
                variant=variant,
                method=args.method,
                factor_update_steps=1,
                inv_update_steps=1,
                kl_clip=0.001,
                grad_worker_fraction=fraction,
                placement_cost=args.placement_cost,
            )
            if variant == "spd-kfac":
                options["fusion_profile_steps"] = args.profile_steps
            key = variant if fraction == fractions[0] else f"{variant}@{fraction:g}"
            result["variants"][key] = _time_kfac(args, comm, x, y, options)
            result["variants"][key]["grad_worker_fraction"] = fraction
            gc.collect()
    result["sgd_iter_s"], sgd = _time_solver(args, comm, x, y, "allreduce", {})
    sgd.close()
    if "spd-kfac" in variants and "d-kfac" in variants:
        result["spd_over_d"] = result["variants"]["spd-kfac"]["iter_s"] / result["variants"]["d-kfac"]["iter_s"]
    if "spd-kfac" in variants:
        result["inversion_load_max_over_mean"] = result["variants"]["spd-kfac"]["inversion_load_max_over_mean"]
    return result


def _time_solver(
    args: argparse.Namespace,
    comm: Communicator,
    x: torch.Tensor,
    y: torch.Tensor,
    name: str,
    options: dict[str, Any],
    before_timing: Callable[[Solver], object] | None = None,
) -> tuple[float, Solver]:
    """Median seconds of one training iteration after warming up, and the solver (to inspect, then close)."""
    torch.manual_seed(0)
    model = build_model(args.model, *MODEL_INPUTS[args.model]).to(x.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    solver = make_solver(name, model, optimizer, comm=comm.comm, **options)
    loss_fn = nn.CrossEntropyLoss()

    def iteration() -> None:
        solver.zero_grad()
        loss_fn(model(x), y).backward()
        solver.step()

    for _ in range(args.warmup + (args.profile_steps + 1 if options.get("variant") == "spd-kfac" else 0)):
        iteration()
    if before_timing is not None:
        before_timing(solver)
    seconds = median_seconds(iteration, comm, args.repeats, warmup=0)
    return seconds, solver


def _reset_timings(solver: Solver) -> None:
    assert isinstance(solver, KFACSolver)  # given to K-FAC runs only
    solver.reset_timings()


def _time_kfac(
    args: argparse.Namespace,
    comm: Communicator,
    x: torch.Tensor,
    y: torch.Tensor,
    options: dict[str, Any],
) -> dict[str, Any]:
    seconds, solver = _time_solver(args, comm, x, y, "kfac", options, _reset_timings)
    assert isinstance(solver, KFACSolver)  # make_solver("kfac") builds one
    breakdown = {phase: comm.reduce_scalar(solver.timings[phase] / args.repeats, op="max") for phase in PHASES}
    inversion_s = comm.allgather_object(solver.timings["inversion"] / args.repeats)
    work_s = comm.allgather_object((solver.timings["inversion"] + solver.timings["precondition"]) / args.repeats)
    loads = solver.placement_loads()
    workers = solver.inverting_ranks
    entry: dict[str, Any] = {
        "iter_s": seconds,
        "breakdown": breakdown,
        "inverting_ranks": len(workers),
        "inversion_load_max_over_mean": max_over_mean([loads[r] for r in workers]),
        "inversion_s_max_over_mean": max_over_mean([inversion_s[r] for r in workers]),
        "predicted_over_measured": [load / w if w > 0 else None for load, w in zip(loads, work_s)],
        "gradient_workers": len(solver.groups[0]),
        "factors": len(solver.factors),
        "replicated_factors": sum(1 for o in solver.owners if o == EVERY_RANK),
        "factor_messages": len(solver.exchange.groups),
        "inverse_broadcasts": len(solver.inverter.messages),
        "gradient_broadcasts": sum(1 for r in solver.sharing.roots if r != solver.sharing.comm.rank)
        if solver.sharing.active
        else 0,
        "packed_inverses": sum(solver.inverse_packed),
    }
    if solver.comm_models:
        entry["comm_models"] = {
            k: {"alpha_s": m.alpha, "beta_s_per_elem": m.beta} for k, m in solver.comm_models.items()
        }
    solver.close()
    return entry
