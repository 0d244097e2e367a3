"""Test accuracy against training wall time and against epochs, one line per run.

``python -m mpisolve plot RUN.jsonl ... [--out DIR]`` draws them from JSON Lines logs
in one process (no mpiexec); ``compare`` draws the same after its runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..options import InputError
from .metrics import read_records

PLOTS = {"accuracy_vs_time.png": ("wall_s", "training wall time (s)"), "accuracy_vs_epochs.png": ("epoch", "epochs")}


def plot_runs(runs: Mapping[str, Sequence[dict[str, Any]]], out: str | Path, *, title: str = "") -> list[Path]:
    """Write the two plots of ``runs`` (label -> records) into ``out``; returns their paths."""
    try:
        import matplotlib
    except ImportError:
        raise InputError("plots need matplotlib: pip install 'mpisolve[train]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for filename, (key, label) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name, records in runs.items():
            points = [(r[key], r["test_accuracy"]) for r in records if r.get("test_accuracy") is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", markersize=3, label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        if title:
            ax.set_title(title)
        if runs:
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / filename, dpi=120)
        plt.close(fig)
        paths.append(out / filename)
    return paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", metavar="RUN.jsonl", help="JSON Lines logs of train or compare runs")
    parser.add_argument("--out", metavar="DIR", help="write the PNGs here (default: the first log's directory)")


def run(args: argparse.Namespace) -> int:
    runs = {}
    for log in args.logs:
        label = Path(log).name.removesuffix(".jsonl")
        if label in runs:
            label = str(Path(log).with_suffix(""))
        runs[label] = read_records(log)
    for path in plot_runs(runs, args.out or Path(args.logs[0]).parent):
        print(path)
    return 0
