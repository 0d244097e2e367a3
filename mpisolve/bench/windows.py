"""``bench windows``: what one exchange with a SharedVector costs, per path, mode and layout.

Every rank updates the whole vector at once (the elastic exchange of ``ea-wild`` /
``async-easgd``), so the figures include contention. ``progress_overhead`` is the slowdown
of a compute loop while this rank's progress thread runs (inter-node path).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from ..comm.communicator import Communicator
from ..comm.windows import SharedVector
from ..kernels.elastic import elastic_exchange_
from . import median_seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--numel", type=int, default=1_000_000, help="elements of the float32 vector")


def run(args: argparse.Namespace, comm: Communicator) -> dict:
    x = torch.randn(args.numel)
    result: dict = {"ranks": comm.size, "nodes": comm.nodes, "numel": args.numel}
    for force_internode in (False, True):
        for locked in (False, True):
            for layout in ("sharded", "server"):
                options = {"layout": layout, "locked": locked, "force_internode": force_internode}
                with SharedVector(comm, args.numel, torch.float32, **options) as v:
                    v.store_(x)

                    def exchange() -> None:
                        v.update(lambda center, start, stop: elastic_exchange_(x[start:stop], center, 0.1))

                    seconds = median_seconds(exchange, comm, args.repeats, args.warmup)
                    key = f"{v.path}_{'locked' if locked else 'wild'}_{layout}_s"
                    result[key] = seconds
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def compute() -> None:
        for _ in range(100):
            torch.mm(a, b)

    times: dict[str, list[float]] = {"none": [], "thread": []}
    for _ in range(args.repeats):  # interleaved, so that drifting machine load hits both alike
        for progress, seconds in times.items():
            with SharedVector(comm, 1024, torch.float32, force_internode=True, progress=progress):
                seconds.append(median_seconds(compute, comm, 1, 0))
    for progress, seconds in times.items():
        result[f"compute_progress_{progress}_s"] = statistics.median(seconds)
    result["progress_overhead"] = result["compute_progress_thread_s"] / result["compute_progress_none_s"] - 1
    return result
