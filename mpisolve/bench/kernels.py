"""``bench kernels``: every kernel against its plain torch/numpy equivalent on the same data.

Imports each kernel module of :data:`KERNEL_MODULES` and times each of its
``bench_cases(numel)``: ``kernel_s`` and
``reference_s`` are medians over ``--repeats`` (after ``--warmup`` untimed calls, which
also compile Numba code), ``kernel_over_reference`` their ratio: below 1 the kernel is
faster. Tensors are on the CPU (torch and Numba use ``threads`` threads each; under
mpiexec, each rank its share of the node's cores, and each time is the slowest rank's),
or with ``--device cuda`` on this rank's GPU (the numba.cuda and CuPy twins against torch
on the GPU, each time including the wait for the GPU work it queued).
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from ..comm.communicator import Communicator
from ..errors import InputError
from ..kernels.dispatch import parallel_threads
from . import add_device_argument, bench_device, median_seconds

#: Kernel modules under ``mpisolve.kernels``, one per operation.
KERNEL_MODULES = ("fused", "adasum", "inverse", "triangle", "elastic")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--numel", type=int, default=1 << 22, help="elements of data per case (default 4194304)")
    parser.add_argument("--kernels", nargs="+", choices=KERNEL_MODULES, help="only these kernel modules")
    add_device_argument(parser)


def run(args: argparse.Namespace, comm: Communicator) -> dict[str, Any]:
    if args.numel < 1:
        raise InputError("--numel must be >= 1")
    device = bench_device(args, comm)
    result: dict[str, Any] = {
        "ranks": comm.size,
        "device": str(device),
        "numel": args.numel,
        "threads": parallel_threads(),
        "mpi_cuda_aware": comm.cuda_aware,
        "mpi_cuda_aware_source": comm.cuda_aware_source,
        "cases": {},
    }
    for name in args.kernels or KERNEL_MODULES:
        module = importlib.import_module(f"mpisolve.kernels.{name}")
        for case in module.bench_cases(args.numel, device):
            kernel_s = median_seconds(case.kernel, comm, args.repeats, args.warmup)
            reference_s = median_seconds(case.reference, comm, args.repeats, args.warmup)
            result["cases"][f"{name}.{case.name}"] = {
                "kernel_s": kernel_s,
                "reference_s": reference_s,
                "kernel_over_reference": kernel_s / reference_s,
            }
    return result
