"""``bench allreduce``: the allreduce solver's fused gradient allreduce against MPI and gloo.

On the same gradient tensors, in the same run: ``mpisolve_s`` (the solver's bucketed
persistent allreduce and averaging, as in a training step), ``mpi_contiguous_s`` (one
MPI Allreduce of a contiguous buffer of the same total size: the MPI limit) and
``gloo_s`` (torch.distributed's gloo allreduce of the same buckets, as DDP issues them).
``busbw_GBps`` is nccl-tests' bus bandwidth of ``mpisolve_s``: bytes / time * 2(n-1)/n.
With ``--device cuda`` every tensor is on this rank's GPU: mpisolve's buckets and the
contiguous buffer go to MPI staged or directly, as the communicator decided (``staged``
says which), and gloo reduces the same CUDA tensors.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Callable
from typing import Any

import torch
from mpi4py import MPI

from ..comm.buckets import GradientBuckets, plan_buckets
from ..comm.communicator import Communicator, mpi_buffer
from ..errors import InputError
from ..train.models import MODELS, build_model
from . import add_device_argument, bench_device, median_seconds

MODEL_INPUTS = {"mlp": ((1, 8, 8), 10), "cnn": ((3, 32, 32), 10), "resnet18": ((3, 32, 32), 10)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS), help="use this model's gradient tensors")
    parser.add_argument("--numel", type=int, help="total elements, split over --tensors tensors")
    parser.add_argument("--tensors", type=int, default=1, help="number of tensors for --numel")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size, as the solver's bucket_mb")
    parser.add_argument("--no-gloo", action="store_true", help="skip the torch.distributed gloo comparison")
    parser.add_argument(
        "--node-shm",
        choices=("on", "off"),
        default="on",
        help="mpisolve's buckets in node-shared memory where they apply (off: MPI's path); both: --compare-paths",
    )
    parser.add_argument(
        "--compare-paths", action="store_true", help="also time the buckets on MPI's path (mpisolve_mpi_path_s)"
    )
    add_device_argument(parser)


def gradient_params(args: argparse.Namespace, device: torch.device | str = "cpu") -> list[torch.nn.Parameter]:
    """The benchmark's tensors: a model's parameters, or --numel split into --tensors odd sizes."""
    if (args.model is None) == (args.numel is None):
        raise InputError("give exactly one of --model or --numel")
    if args.model is not None:
        in_shape, classes = MODEL_INPUTS[args.model]
        return list(build_model(args.model, in_shape, classes).to(device).parameters())
    if args.numel < 1 or args.tensors < 1 or args.tensors > args.numel:
        raise InputError("--numel and --tensors must be >= 1, with --tensors <= --numel")
    base, extra = divmod(args.numel, args.tensors)
    return [torch.nn.Parameter(torch.zeros(base + (i < extra), device=device)) for i in range(args.tensors)]


def contiguous_allreduce(contiguous: torch.Tensor, comm: Communicator) -> Callable[[], None]:
    """One MPI allreduce of a contiguous buffer, the MPI limit: MPI_Allreduce itself on host
    memory, through the communicator (staged or direct) on a GPU."""
    spec = mpi_buffer(contiguous)

    def allreduce() -> None:
        if contiguous.is_cuda:
            comm.allreduce_(contiguous, what="contiguous allreduce")
        else:
            comm.comm.Allreduce(MPI.IN_PLACE, spec, MPI.SUM)

    return allreduce


def run(args: argparse.Namespace, comm: Communicator) -> dict[str, Any]:
    if args.bucket_mb <= 0:
        raise InputError("--bucket-mb must be > 0")
    device = bench_device(args, comm)
    params = gradient_params(args, device)
    bucket_bytes = int(args.bucket_mb * 1e6)
    numel = sum(p.numel() for p in params)
    mpi_contiguous = contiguous_allreduce(torch.randn(numel, device=device), comm)
    result: dict[str, Any] = {
        "ranks": comm.size,
        "device": str(device),
        "staged": comm.needs_staging(params[0]),
        "numel": numel,
        "tensors": len(params),
        "mpi_library": comm.library_version(),
    }
    solver_comm = Communicator(comm.comm, node_shm=args.node_shm == "on")
    result["mpisolve_s"], result["buckets"], result["node_shm"] = solver_allreduce_seconds(
        params, solver_comm, bucket_bytes, args.repeats, args.warmup
    )
    result["nodes"], result["ranks_per_node"] = comm.nodes, comm.local_size
    if args.compare_paths:
        mpi_path = Communicator(comm.comm, node_shm=False)
        result["mpisolve_mpi_path_s"], _, _ = solver_allreduce_seconds(
            params, mpi_path, bucket_bytes, args.repeats, args.warmup
        )
    result["mpi_contiguous_s"] = median_seconds(mpi_contiguous, comm, args.repeats, args.warmup)
    if not args.no_gloo:
        result["gloo_s"] = gloo_seconds(params, bucket_bytes, comm, args, device)
        result["mpisolve_over_gloo"] = result["mpisolve_s"] / result["gloo_s"]
    result["mpisolve_over_mpi_contiguous"] = result["mpisolve_s"] / result["mpi_contiguous_s"]
    if args.compare_paths:
        result["mpi_path_over_mpi_contiguous"] = result["mpisolve_mpi_path_s"] / result["mpi_contiguous_s"]
    nbytes = numel * 4
    result["busbw_GBps"] = nbytes / result["mpisolve_s"] * 2 * (comm.size - 1) / comm.size / 1e9
    return result


def solver_allreduce_seconds(
    params: list[torch.nn.Parameter], comm: Communicator, bucket_bytes: int, repeats: int, warmup: int
) -> tuple[float, int, bool]:
    """Median seconds of the allreduce solver's averaging of ``params``' gradients (its
    fused buckets of ``bucket_bytes``, as in a training step), the number of buckets, and
    whether they were node-shared (then each repeat sums gradients already in the window
    and the result is read where it lies, as in the solver).

    The gradients become views into the buckets (random values) until this returns.
    """
    grads = GradientBuckets(params, comm, bucket_bytes=bucket_bytes, average=True)
    try:
        for p in params:
            assert p.grad is not None  # GradientBuckets made it a view into its bucket
            p.grad.normal_()

        def mpisolve_allreduce() -> None:
            grads.rearm()
            grads.finish()

        return median_seconds(mpisolve_allreduce, comm, repeats, warmup), len(grads.buckets), grads.node is not None
    finally:
        grads.close()


def gloo_seconds(
    params: list[torch.nn.Parameter],
    bucket_bytes: int,
    comm: Communicator,
    args: argparse.Namespace,
    device: torch.device | str = "cpu",
) -> float:
    """torch.distributed gloo on the same tensors, in DDP's buckets (flat, reduced async, averaged)."""
    import torch.distributed as dist

    address = comm.bcast_object(socket.gethostname() if comm.rank == 0 else None)
    port = comm.bcast_object(_free_port() if comm.rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=comm.rank, world_size=comm.size)
    try:
        ordered = params[::-1]
        flats = [
            torch.randn(sum(ordered[i].numel() for i in members), device=device)
            for members in plan_buckets(ordered, bucket_bytes)
        ]

        def gloo_allreduce() -> None:
            works = [dist.all_reduce(flat, async_op=True) for flat in flats]
            for flat, work in zip(flats, works):
                work.wait()
                flat.div_(comm.size)

        return median_seconds(gloo_allreduce, comm, args.repeats, args.warmup)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
