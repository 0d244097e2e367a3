"""``python -m mpi4py -m mpisolve compare``: several solvers, one workload, one seed.

Runs each solver in turn in the same MPI job (same data, same initial model, same
heterogeneity), then writes ``DIR/summary.json``, each run's ``DIR/<solver>.jsonl`` and
``DIR/<solver>.summary.json``, the PNG plots of :mod:`mpisolve.train.plots`, and a table
on stdout; with ``--tensorboard TB``, each solver's scalars go to ``TB/<solver>`` (one
run each in TensorBoard). ``summary.json``::

    {"solvers": {name: {"time_to_target_s": float or null, "epochs_to_target": float or null,
                        "final_accuracy": float,
                        "samples_per_s": float, "busy_fraction": float}},
     "ranks": 4, "target_accuracy": 0.9 or null, "workload": {...},
     "mpi_library_version": "...", "versions": {...}, "git_commit": "...",
     "logs": {name: "<solver>.jsonl"}}
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from ..comm.communicator import Communicator
from . import config as train_settings
from .config import CompareConfig
from .loop import train
from .metrics import read_records, write_json
from .plots import plot_runs

#: Per-solver fields of summary.json, taken from each run's summary.
SOLVER_FIELDS = ("time_to_target_s", "epochs_to_target", "final_accuracy", "samples_per_s", "busy_fraction")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--solvers", metavar="A,B,...", default=argparse.SUPPRESS, help="solvers to compare, or 'all' (default: all)"
    )
    parser.add_argument(
        "--out", metavar="DIR", default=argparse.SUPPRESS, help="output directory (default: runs/compare)"
    )
    train_settings.add_arguments(parser, compare=True)


def run(args: argparse.Namespace) -> int:
    from ..comm import init

    comm = init()
    plan = comm.agree(lambda: train_settings.compare_config(args, comm.size))
    result = compare(plan, comm)
    if comm.rank == 0:
        print(table(result), flush=True)
    return 0


def compare(plan: CompareConfig, comm: Communicator, *, show: bool = True) -> dict[str, Any]:
    """Run every solver of ``plan`` in turn; rank 0 writes the outputs. Returns summary.json's content."""
    out = Path(plan.out)
    summaries = {}
    device_ms = None  # --device-ms auto: calibrated by the first run, then the same device for every solver
    for config in plan.runs:
        config = dataclasses.replace(config, log=str(out / f"{config.solver}.jsonl"))
        if config.tensorboard is not None:
            config = dataclasses.replace(config, tensorboard=str(Path(config.tensorboard) / config.solver))
        if config.device_ms == "auto" and device_ms is not None:
            config = dataclasses.replace(config, device_ms=device_ms)
        summary = summaries[config.solver] = train(config, comm, show=show)
        if summary["device_ms_per_sample"] is not None:
            device_ms = repr(summary["device_ms_per_sample"])
    first = next(iter(summaries.values()))
    result = {
        "solvers": {name: {key: s[key] for key in SOLVER_FIELDS} for name, s in summaries.items()},
        "ranks": comm.size,
        "target_accuracy": first["target_accuracy"],
        "workload": first["workload"],
        "mpi_library_version": first["mpi_library_version"],
        "versions": first["versions"],
        "git_commit": first["git_commit"],
        "logs": {name: f"{name}.jsonl" for name in summaries},
    }
    if comm.rank == 0:
        write_json(out / "summary.json", result)
        runs = {name: read_records(out / log) for name, log in result["logs"].items()}
        workload = result["workload"]
        plot_runs(runs, out, title=f"{workload['model']} on {workload['dataset']}, {comm.size} ranks")
    return result


def table(result: dict[str, Any]) -> str:
    """summary.json as a fixed-width table."""
    target = result["target_accuracy"]
    to = f"to {target:g}" if target is not None else "to target"
    head = ("solver", f"time {to} (s)", f"epochs {to}", "final acc", "samples/s", "busy")
    rows = [head]
    for name, s in result["solvers"].items():
        tta, eta = s["time_to_target_s"], s["epochs_to_target"]
        acc = s["final_accuracy"]
        rows.append(
            (
                name,
                "-" if tta is None else f"{tta:.2f}",
                "-" if eta is None else f"{eta:.2f}",
                "-" if acc is None else f"{acc:.4f}",
                f"{s['samples_per_s']:.0f}",
                f"{s['busy_fraction']:.2f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
