"""``bench step``: a solver's training step against plain PyTorch's, same model, batch and device.

Timed in turn within each repeat (medians, the slowest rank's): ``solver_s`` is
``solver.zero_grad()``, forward, backward and ``solver.step()``; ``plain_s`` the same
iteration with the optimizer alone (``optimizer.zero_grad()``, ``optimizer.step()``) on
an identical model, no solver, no communication. ``solver_over_plain`` is their ratio: at
one rank, the solver's own overhead (buckets, hooks, staging, checks); at more ranks, with
its communication. ``--device cuda`` runs both on this rank's GPU (several ranks may share
one), each time including the wait for the GPU work it queued.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..options import InputError
from ..solvers import make_solver, solvers
from ..solvers.base import solver_class
from ..train.models import MODELS, build_model
from . import add_device_argument, bench_device, interleaved_medians
from .allreduce import MODEL_INPUTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet18")
    parser.add_argument("--batch", type=int, default=32, help="examples per rank per step")
    parser.add_argument("--solver", default="allreduce", help="the solver to time (default allreduce)")
    add_device_argument(parser)


def run(args: argparse.Namespace, comm: Communicator) -> dict[str, Any]:
    if args.batch < 1:
        raise InputError("--batch must be >= 1")
    if args.solver not in solvers():
        raise InputError(f"--solver must be one of {', '.join(solvers())}, got {args.solver!r}")
    device = bench_device(args, comm)
    in_shape, classes = MODEL_INPUTS[args.model]
    generator = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(args.batch, *in_shape, generator=generator).to(device)
    y = torch.randint(0, classes, (args.batch,), generator=generator).to(device)
    loss_fn = nn.CrossEntropyLoss()

    # Solvers that apply their own momentum (async-msgd, async-measgd) take an optimizer without.
    momentum = 0.0 if "momentum" in {f.name for f in dataclasses.fields(solver_class(args.solver).Options)} else 0.9

    def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = build_model(args.model, in_shape, classes).to(device)
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=momentum)

    plain_model, plain_optimizer = model_and_optimizer()
    model, optimizer = model_and_optimizer()
    solver = make_solver(args.solver, model, optimizer, comm)

    def plain() -> None:
        plain_optimizer.zero_grad()
        loss_fn(plain_model(x), y).backward()
        plain_optimizer.step()

    def with_solver() -> None:
        solver.zero_grad()
        loss_fn(model(x), y).backward()
        solver.step()

    steps: dict[str, Callable[[], None]] = {"solver_s": with_solver, "plain_s": plain}
    try:
        timings = interleaved_medians(steps, comm, args.repeats, args.warmup)
    finally:
        solver.close()
    return {
        "model": args.model,
        "solver": args.solver,
        "batch_per_rank": args.batch,
        "device": str(device),
        "ranks": comm.size,
        "staged": comm.needs_staging(next(model.parameters())),
        "mpi_library": comm.library_version(),
        **timings,
        "solver_over_plain": timings["solver_s"] / timings["plain_s"],
    }
