"""``python -m mpisolve bench <name>``: benchmarks that print one JSON object on rank 0.

Each benchmark is a module here exposing ``add_arguments(parser)`` and ``run(args) ->
dict``; timings are medians over repeats measured in the same run, so their ratios
hold on a noisy machine even when absolute seconds do not.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..comm.communicator import Communicator

import torch

#: benchmark -> (module, one line for ``bench --help``). Each module's docstring says more.
BENCHES: dict[str, tuple[str, str]] = {
    "allreduce": ("mpisolve.bench.allreduce", "the allreduce solver's gradient allreduce vs MPI and gloo"),
    "kernels": ("mpisolve.bench.kernels", "each kernel against its plain torch/numpy equivalent"),
    "windows": ("mpisolve.bench.windows", "one SharedVector exchange (EA-wild's) by path, mode and size"),
    "adasum": ("mpisolve.bench.adasum", "Adasum against a sum allreduce of the same tensors"),
    "kfac": ("mpisolve.bench.kfac", "one iteration of each K-FAC variant and of SGD, by phase"),
    "soak": ("mpisolve.bench.soak", "long asynchronous runs: memory must not grow, windows freed"),
    "sweep": ("mpisolve.bench.sweep", "allreduce latency and bus bandwidth over message sizes"),
    "step": ("mpisolve.bench.step", "a solver's whole training step against plain PyTorch's (--ddp: and DDP's)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    width = max(map(len, BENCHES))
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # the list below, as laid out
    parser.description = "benchmarks (mpisolve bench NAME --help: its options):\n" + "\n".join(
        f"  {name:<{width}}  {help_text}" for name, (_, help_text) in BENCHES.items()
    )
    sub = parser.add_subparsers(dest="bench", metavar="benchmark", help="one of the benchmarks above")
    sub.required = True
    for name, (module, help_text) in BENCHES.items():
        p = sub.add_parser(name, description=help_text)
        p.set_defaults(bench_module=module)
        p.add_argument("--repeats", type=int, default=10, help="timed repeats (the median is reported)")
        p.add_argument("--warmup", type=int, default=2, help="untimed repeats first")
        importlib.import_module(module).add_arguments(p)


def run(args: argparse.Namespace) -> int:
    from ..comm import init
    from ..errors import InputError

    if args.repeats < 1 or args.warmup < 0:
        raise InputError("--repeats must be >= 1 and --warmup >= 0")
    comm = init()
    result = importlib.import_module(args.bench_module).run(args, comm)
    if comm.rank == 0:
        print(json.dumps(result), flush=True)
    return 0


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """``--device``: the benchmark's tensors on the CPU or on this rank's GPU (``comm.device``)."""
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the benchmark's tensors live: cpu, or cuda (this rank's GPU; MPI staged or direct as detected)",
    )


def bench_device(args: argparse.Namespace, comm: Communicator) -> torch.device:
    """The device ``--device`` names for this rank; an input error on every rank without CUDA."""
    if args.device == "cpu":
        return torch.device("cpu")
    comm.agree(_require_cuda)
    return comm.device


def _require_cuda() -> None:
    from ..errors import InputError

    if not torch.cuda.is_available():
        raise InputError("--device cuda needs a CUDA device, and torch sees none here")


def median_seconds(fn: Callable[[], object], comm: Communicator, repeats: int, warmup: int) -> float:
    """Median wall seconds of ``fn`` over ``repeats``, all ranks starting together each time.

    Each repeat's time is the slowest rank's, as a collective's time is.
    """
    return interleaved_medians({"fn": fn}, comm, repeats, warmup)["fn"]


def interleaved_medians(
    fns: Mapping[str, Callable[[], object]], comm: Communicator, repeats: int, warmup: int
) -> dict[str, float]:
    """:func:`median_seconds` of several functions, timed in turn within each repeat, so
    that load from outside the benchmark falls on all of them alike and their ratios hold."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            comm.barrier()
            start = time.perf_counter()
            fn()
            # is_initialized(), not is_available() (microseconds): a GPU used by fn is initialised by now.
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()  # the GPU work fn queued is part of its time
            times[name].append(comm.reduce_scalar(time.perf_counter() - start, op="max"))
    return {name: statistics.median(t) for name, t in times.items()}


def write_csv(path: str, rows: list[dict[str, Any]], fields: Sequence[str]) -> None:
    """A benchmark's rows as CSV (its directory created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields))
        writer.writeheader()
        writer.writerows(rows)
