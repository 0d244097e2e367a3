"""``bench adasum``: Adasum against mpisolve's own sum allreduce of the same tensors.

Same tensors, same run, timed in turn within each repeat: ``adasum_s`` (``mpisolve.allreduce(tensors, op="adasum")``),
``sum_s`` (``op="sum"``, the same fusing and the same one-shot buffers) and
``mpi_contiguous_s`` (one MPI Allreduce of a contiguous buffer of the same size: the MPI
limit). ``adasum_buckets_s`` and ``sum_buckets_s`` time the solvers' path on gradient
buckets, set up once: the Adasum reducer against the persistent sum allreduce. With
``--device cuda`` the tensors are on this rank's GPU (Adasum's kernels run there; MPI
staged or direct as the communicator decided). ``--compare-paths`` adds both Adasum figures
on MPI's message path (``node_shm`` off: ``adasum_mpi_path_s``, ``adasum_buckets_mpi_path_s``),
timed in the same repeats, against the node path where ranks share a node
(:class:`~mpisolve.comm.adasum.AdasumReduction`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from ..comm.adasum import AdasumReducer
from ..comm.buckets import GradientBuckets
from ..comm.collectives import allreduce
from ..comm.communicator import Communicator
from ..errors import InputError
from . import add_device_argument, bench_device, interleaved_medians
from .allreduce import contiguous_allreduce, gradient_params


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..train.models import MODELS

    parser.add_argument("--model", choices=sorted(MODELS), help="use this model's parameter tensors")
    parser.add_argument("--numel", type=int, help="total elements, split over --tensors tensors")
    parser.add_argument("--tensors", type=int, default=1, help="number of tensors for --numel")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size of the bucketed figures")
    parser.add_argument(
        "--compare-paths",
        action="store_true",
        help="also time Adasum on MPI's message path, node-shared memory off (adasum_mpi_path_s, "
        "adasum_buckets_mpi_path_s)",
    )
    add_device_argument(parser)


def run(args: argparse.Namespace, comm: Communicator) -> dict[str, Any]:
    if args.bucket_mb <= 0:
        raise InputError("--bucket-mb must be > 0")
    device = bench_device(args, comm)
    params = gradient_params(args, device)
    generator = torch.Generator().manual_seed(comm.rank)
    tensors = [torch.randn(p.shape, generator=generator).to(device) for p in params]
    numel = sum(t.numel() for t in tensors)
    mpi_contiguous = contiguous_allreduce(torch.randn(numel, generator=generator).to(device), comm)

    bucket_bytes = int(args.bucket_mb * 1e6)
    reducer = AdasumReducer(comm)
    adasum_grads = GradientBuckets(params, comm, bucket_bytes=bucket_bytes, reducer=reducer)
    sum_grads = GradientBuckets(
        [torch.nn.Parameter(p.detach().clone()) for p in params], comm, bucket_bytes=bucket_bytes
    )
    paths = [adasum_grads, sum_grads]
    mpi_path: dict[str, Callable[[], object]] = {}
    if args.compare_paths:
        messages = Communicator(comm.comm, node_shm=False)
        message_grads = GradientBuckets(params, messages, bucket_bytes=bucket_bytes, reducer=AdasumReducer(messages))
        paths.append(message_grads)
    for grads in paths:
        for p in grads.params:
            assert p.grad is not None  # GradientBuckets made it a view into its bucket
            p.grad.copy_(torch.randn(p.shape, generator=generator))

    def buckets(grads: GradientBuckets) -> Callable[[], None]:
        def reduce() -> None:
            grads.rearm()
            grads.finish()

        return reduce

    if args.compare_paths:
        mpi_path = {
            "adasum_mpi_path_s": lambda: allreduce(tensors, "adasum", messages),
            "adasum_buckets_mpi_path_s": buckets(message_grads),
        }
    timings = interleaved_medians(
        {
            "adasum_s": lambda: allreduce(tensors, "adasum", comm),
            "sum_s": lambda: allreduce(tensors, "sum", comm),
            "mpi_contiguous_s": mpi_contiguous,
            "adasum_buckets_s": buckets(adasum_grads),
            "sum_buckets_s": buckets(sum_grads),
            **mpi_path,
        },
        comm,
        args.repeats,
        args.warmup,
    )
    result: dict[str, Any] = {
        "ranks": comm.size,
        "device": str(device),
        "numel": numel,
        "tensors": len(tensors),
        "buckets": len(adasum_grads.buckets),
        "mpi_library": comm.library_version(),
        **timings,
        "adasum_over_sum": timings["adasum_s"] / timings["sum_s"],
        "adasum_over_sum_buckets": timings["adasum_buckets_s"] / timings["sum_buckets_s"],
        "node_path": any(r.node is not None for r in reducer.reductions.values()),
    }
    if args.compare_paths:
        result["node_over_mpi_path"] = timings["adasum_s"] / timings["adasum_mpi_path_s"]
        result["node_over_mpi_path_buckets"] = timings["adasum_buckets_s"] / timings["adasum_buckets_mpi_path_s"]
    for grads in paths:
        grads.close()
    return result
