"""``bench step``: one training step of the ``allreduce`` solver against DDP on gloo, same model, same data.

Every rank builds the same model (``--model``) and its own batch of ``--batch-size``
random inputs, and times, interleaved within each repeat so that outside load falls on
all alike:

- ``mpisolve_s``: ``solver.zero_grad()``, forward, backward, ``solver.step()`` with the
  ``allreduce`` solver (node-shared buckets where they apply; ``--node-shm off``: MPI's path);
- ``ddp_gloo_s``: the same step with ``torch.nn.parallel.DistributedDataParallel`` on gloo
  and the same optimizer (its default 25 MB buckets, as ``bucket_mb``);
- ``floor_s``: the same step with no communication at all (the model and optimizer alone).

It prints the medians and ``mpisolve_over_ddp`` (the goal in docs/studies/node-aware.md)
and ``floor_over_ddp`` (the best any communication scheme could reach).
"""

from __future__ import annotations

import argparse
import copy
import socket
from typing import Any

import torch

from ..comm.communicator import Communicator
from ..options import InputError
from ..solvers.allreduce import AllreduceSolver
from ..train.models import MODELS, build_model
from . import interleaved_medians
from .allreduce import MODEL_INPUTS, _free_port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp", help="the model to train")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size (DDP's bucket_cap_mb alike)")
    parser.add_argument(
        "--node-shm", choices=("on", "off"), default="on", help="node-shared gradient buckets where they apply"
    )


def run(args: argparse.Namespace, comm: Communicator) -> dict[str, Any]:
    import torch.distributed as dist

    if args.batch_size < 1 or args.bucket_mb <= 0:
        raise InputError("--batch-size must be >= 1 and --bucket-mb > 0")
    in_shape, classes = MODEL_INPUTS[args.model]
    torch.manual_seed(0)
    base = build_model(args.model, in_shape, classes)
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(args.batch_size, *in_shape, generator=g)
    y = torch.randint(0, classes, (args.batch_size,), generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()

    def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    solver_comm = Communicator(comm.comm, node_shm=args.node_shm == "on")
    ours = copy.deepcopy(base)
    solver = AllreduceSolver(ours, optimizer(ours), solver_comm, bucket_mb=args.bucket_mb)
    alone = copy.deepcopy(base)
    alone_opt = optimizer(alone)
    address = comm.bcast_object(socket.gethostname() if comm.rank == 0 else None)
    port = comm.bcast_object(_free_port() if comm.rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=comm.rank, world_size=comm.size)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=args.bucket_mb)
        ddp_opt = optimizer(ddp)

        def mpisolve_step() -> None:
            solver.zero_grad()
            loss_fn(ours(x), y).backward()
            solver.step()

        def ddp_step() -> None:
            ddp_opt.zero_grad()
            loss_fn(ddp(x), y).backward()
            ddp_opt.step()

        def floor_step() -> None:
            alone_opt.zero_grad()
            loss_fn(alone(x), y).backward()
            alone_opt.step()

        medians = interleaved_medians(
            {"mpisolve_s": mpisolve_step, "ddp_gloo_s": ddp_step, "floor_s": floor_step},
            comm,
            args.repeats,
            args.warmup,
        )
    finally:
        dist.destroy_process_group()
        node_buckets = solver.grads.node is not None
        solver.close()
    return {
        "bench": "step",
        "model": args.model,
        "ranks": comm.size,
        "nodes": comm.nodes,
        "batch_size": args.batch_size,
        "node_shm": node_buckets,
        **medians,
        "mpisolve_over_ddp": medians["mpisolve_s"] / medians["ddp_gloo_s"],
        "floor_over_ddp": medians["floor_s"] / medians["ddp_gloo_s"],
        "mpi_library": comm.library_version(),
    }
