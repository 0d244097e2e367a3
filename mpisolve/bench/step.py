"""``bench step``: a solver's training step against plain PyTorch's (and DDP's), same model, batch and device.

Timed in turn within each repeat (medians, the slowest rank's), so that outside load
falls on all alike: ``solver_s`` is ``solver.zero_grad()``, forward, backward and
``solver.step()``; ``plain_s`` the same iteration with the optimizer alone
(``optimizer.zero_grad()``, ``optimizer.step()``) on an identical model, no solver, no
communication: the floor any communication scheme could reach. For the solvers that add
their own Nesterov momentum to each local step (``async-msgd``, ``async-measgd``) plain
PyTorch steps with torch's SGD and that momentum (``nesterov=True``): the same update.
``--set key=value`` gives the solver an option (as ``train``'s). ``solver_over_plain`` is
their ratio: at one rank, the solver's own overhead (buckets, hooks, staging, checks); at
more ranks, with its communication. ``--ddp`` also times the step with
``torch.nn.parallel.DistributedDataParallel`` on gloo and the same optimizer (its default
25 MB buckets, as the solvers' ``bucket_mb``): ``ddp_gloo_s``, ``solver_over_ddp`` and
``plain_over_ddp``. ``--device cuda`` runs them on this rank's GPU (several ranks may share
one), each time including the wait for the GPU work it queued. ``--node-shm off`` keeps
the solver's sums on MPI's path where node-shared memory would apply (``node_shm`` says
whether the solver's sums ran in node-shared memory: :attr:`Solver.node_shared`).
``--horovod`` also times the step through ``mpisolve.horovod``'s ``DistributedOptimizer``
(``optimizer.zero_grad()``, forward, backward, ``optimizer.step()``; its op is Average, or
Adasum for ``--solver adasum``) on the world communicator: ``horovod_s`` and
``horovod_over_solver``.
``--optimizer nesterov-foreach`` steps ``SGD(momentum=0.9, nesterov=True, foreach=True)``,
which adds its momentum into ``p.grad`` in place: on the node-shared path each rank then
steps on its own copy of the summed gradients (docs/internals/comm.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import socket
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..comm.communicator import Communicator
from ..errors import InputError
from ..options import options_to_dict, parse_option
from ..solvers import make_solver, solver_names
from ..solvers.base import solver_class
from ..train.models import MODELS, build_model
from . import add_device_argument, bench_device, interleaved_medians
from .allreduce import MODEL_INPUTS, _free_port

OPTIMIZERS = ("sgd", "nesterov-foreach")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet18")
    parser.add_argument("--batch", type=int, default=32, help="examples per rank per step")
    parser.add_argument("--solver", default="allreduce", help="the solver to time (default allreduce)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a solver option (repeatable), as train's --set; e.g. --set factor_update_steps=1",
    )
    parser.add_argument("--ddp", action="store_true", help="also time DistributedDataParallel on gloo (CPU)")
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="sgd",
        help="sgd: SGD with momentum 0.9 (none for solvers with their own); nesterov-foreach: with Nesterov "
        "momentum, foreach, which writes p.grad in place",
    )
    parser.add_argument(
        "--node-shm", choices=("on", "off"), default="on", help="node-shared sums where they apply (off: MPI's path)"
    )
    parser.add_argument(
        "--horovod", action="store_true", help="also time mpisolve.horovod's DistributedOptimizer (allreduce, adasum)"
    )
    add_device_argument(parser)


def run(args: argparse.Namespace, comm: Communicator) -> dict[str, Any]:
    import torch.distributed as dist

    if args.batch < 1:
        raise InputError("--batch must be >= 1")
    if args.solver not in solver_names():
        raise InputError(f"--solver must be one of {', '.join(solver_names())}, got {args.solver!r}")
    if args.horovod and args.solver not in ("allreduce", "adasum"):
        raise InputError("--horovod compares with the allreduce or adasum solver: pass --solver allreduce or adasum")
    if args.ddp and args.device != "cpu":
        raise InputError("--ddp compares with DDP on gloo, on the CPU: leave out --device cuda")
    device = bench_device(args, comm)
    in_shape, classes = MODEL_INPUTS[args.model]
    generator = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(args.batch, *in_shape, generator=generator).to(device)
    y = torch.randint(0, classes, (args.batch,), generator=generator).to(device)
    loss_fn = nn.CrossEntropyLoss()

    # Solvers that apply their own (Nesterov) momentum (async-msgd, async-measgd) take an optimizer
    # without; plain PyTorch then steps with torch's SGD and that momentum, the same update.
    own_momentum = "momentum" in {f.name for f in dataclasses.fields(solver_class(args.solver).Options)}
    if args.optimizer == "nesterov-foreach" and own_momentum:
        raise InputError(f"--optimizer nesterov-foreach: {args.solver} applies its own momentum; leave it at sgd")

    def model_and_optimizer(momentum: float, nesterov: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = build_model(args.model, in_shape, classes).to(device)
        if args.optimizer == "nesterov-foreach":
            return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, foreach=True)
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=momentum, nesterov=nesterov)

    model, optimizer = model_and_optimizer(0.0 if own_momentum else 0.9)
    options = {}
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise InputError(f"--set expects KEY=VALUE, got {item!r}")
        options[key.strip()] = parse_option(args.solver, solver_class(args.solver).Options, key.strip(), text.strip())
    bench_comm = Communicator(comm.comm, node_shm=args.node_shm == "on")
    solver = make_solver(args.solver, model, optimizer, bench_comm, **options)
    if own_momentum:
        plain_model, plain_optimizer = model_and_optimizer(solver.options.momentum, nesterov=True)
    else:
        plain_model, plain_optimizer = model_and_optimizer(0.9)
    node_shm = solver.node_shared

    def plain() -> None:
        plain_optimizer.zero_grad()
        loss_fn(plain_model(x), y).backward()
        plain_optimizer.step()

    def with_solver() -> None:
        solver.zero_grad()
        loss_fn(model(x), y).backward()
        solver.step()

    steps: dict[str, Callable[[], None]] = {"solver_s": with_solver, "plain_s": plain}
    if args.ddp:
        address = comm.bcast_object(socket.gethostname() if comm.rank == 0 else None)
        port = comm.bcast_object(_free_port() if comm.rank == 0 else None)
        dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=comm.rank, world_size=comm.size)
        ddp_base, ddp_optimizer = model_and_optimizer(0.9)
        ddp = nn.parallel.DistributedDataParallel(ddp_base)

        def with_ddp() -> None:
            ddp_optimizer.zero_grad()
            loss_fn(ddp(x), y).backward()
            ddp_optimizer.step()

        steps["ddp_gloo_s"] = with_ddp
    if args.horovod:
        from .. import horovod as hvd

        hvd.init(comm.comm)
        hvd_model, hvd_base = model_and_optimizer(0.9)
        op = hvd.Adasum if args.solver == "adasum" else hvd.Average
        hvd_optimizer = hvd.DistributedOptimizer(hvd_base, named_parameters=hvd_model.named_parameters(), op=op)

        def with_horovod() -> None:
            hvd_optimizer.zero_grad()
            loss_fn(hvd_model(x), y).backward()
            hvd_optimizer.step()

        steps["horovod_s"] = with_horovod
    try:
        timings = interleaved_medians(steps, comm, args.repeats, args.warmup)
    finally:
        solver.close()
        if args.ddp:
            dist.destroy_process_group()
    result = {
        "model": args.model,
        "solver": args.solver,
        "options": options_to_dict(solver.options),
        "engine": bench_comm.engine,
        "optimizer": args.optimizer,
        "batch_per_rank": args.batch,
        "device": str(device),
        "ranks": comm.size,
        "nodes": comm.nodes,
        "node_shm": node_shm,
        "staged": comm.needs_staging(next(model.parameters())),
        "mpi_library": comm.library_version(),
        **timings,
        "solver_over_plain": timings["solver_s"] / timings["plain_s"],
    }
    if args.horovod:
        result["horovod_over_solver"] = timings["horovod_s"] / timings["solver_s"]
    if args.ddp:
        result["solver_over_ddp"] = timings["solver_s"] / timings["ddp_gloo_s"]
        result["plain_over_ddp"] = timings["plain_s"] / timings["ddp_gloo_s"]
    return result
