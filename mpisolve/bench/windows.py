"""``bench windows``: what one exchange with a SharedVector costs, per path, mode, layout and size.

Every rank updates the whole vector at once (the elastic exchange of ``ea-wild`` /
``async-easgd``), so the figures include contention. One row per path, mode, layout and
vector size (``--numel`` takes several sizes, for the performance model's fit of the
window exchange: :func:`mpisolve.perfmodel.calibrate.fit_window`); ``--csv`` writes the
rows. ``progress_overhead`` is the slowdown of a compute loop while this rank's progress
thread runs (inter-node path; ``--no-progress-overhead`` skips it).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from ..comm.communicator import Communicator
from ..comm.progress import Progress
from ..comm.windows import SharedVector
from ..kernels.elastic import elastic_exchange_
from . import median_seconds, write_csv

#: Columns of ``--csv`` (the rows of the result).
CSV_FIELDS = ("ranks", "path", "mode", "layout", "numel", "bytes", "seconds")
PATHS = ("shared", "internode")


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--numel wants element counts separated by commas, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--numel wants element counts >= 1, got {text!r}")
    return sizes


def _paths(text: str) -> list[str]:
    paths = [v.strip() for v in text.split(",") if v.strip()]
    if not paths or any(p not in PATHS for p in paths):
        raise argparse.ArgumentTypeError(f"--paths wants some of {', '.join(PATHS)}, got {text!r}")
    return paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--numel",
        type=_sizes,
        default=[1_000_000],
        metavar="N[,M...]",
        help="elements of the float32 vector, one or several sizes (default 1000000)",
    )
    parser.add_argument(
        "--paths",
        type=_paths,
        default=list(PATHS),
        metavar="P[,Q]",
        help="shared, internode or both (default both; internode is forced on one node)",
    )
    parser.add_argument(
        "--progress-overhead",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure the progress thread's cost to compute (default: yes)",
    )
    parser.add_argument("--csv", help="rank 0 also writes the rows to this CSV file")


def run(args: argparse.Namespace, comm: Communicator) -> dict:
    result: dict = {"ranks": comm.size, "nodes": comm.nodes}
    rows = []
    for numel in args.numel:
        x = torch.randn(numel)
        for path in args.paths:
            for locked in (False, True):
                for layout in ("sharded", "server"):
                    options = {"layout": layout, "locked": locked, "force_internode": path == "internode"}
                    with SharedVector(comm, numel, torch.float32, **options) as v:
                        v.store_(x)
                        seconds = _exchange_seconds(v, x, args, comm)
                        rows.append(
                            {
                                "ranks": comm.size,
                                "path": v.path,
                                "mode": "locked" if locked else "wild",
                                "layout": layout,
                                "numel": numel,
                                "bytes": numel * 4,
                                "seconds": seconds,
                            }
                        )
    result["rows"] = rows
    if args.progress_overhead:
        result.update(_progress_overhead(args, comm))
    if args.csv and comm.rank == 0:
        write_csv(args.csv, rows, CSV_FIELDS)
    return result


def _exchange_seconds(v: SharedVector, x: torch.Tensor, args: argparse.Namespace, comm: Communicator) -> float:
    """The median time of one elastic exchange of ``x`` with the whole of ``v``."""

    def exchange() -> None:
        v.update(lambda center, start, stop: elastic_exchange_(x[start:stop], center, 0.1))

    return median_seconds(exchange, comm, args.repeats, args.warmup)


def _progress_overhead(args: argparse.Namespace, comm: Communicator) -> dict[str, float]:
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def compute() -> None:
        for _ in range(100):
            torch.mm(a, b)

    times: dict[Progress, list[float]] = {"none": [], "thread": []}
    for _ in range(args.repeats):  # interleaved, so that drifting machine load hits both alike
        for progress, seconds in times.items():
            with SharedVector(comm, 1024, torch.float32, force_internode=True, progress=progress):
                seconds.append(median_seconds(compute, comm, 1, 0))
    out = {f"compute_progress_{progress}_s": statistics.median(seconds) for progress, seconds in times.items()}
    out["progress_overhead"] = out["compute_progress_thread_s"] / out["compute_progress_none_s"] - 1
    return out
