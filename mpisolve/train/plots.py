"""Plots of run logs, one line per run: test accuracy, training loss and throughput.

``python -m mpisolve plot RUN.jsonl ... [--out DIR]`` draws them from JSON Lines logs
in one process (no mpiexec); ``compare`` draws the same after its runs. Each plot is a
record field against another (:data:`PLOTS`); records without the field (the test
accuracy between evaluations) are left out of its line.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InputError
from .metrics import read_records

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: file -> (x field, x label, y field, y label)
PLOTS = {
    "accuracy_vs_time.png": ("wall_s", "training wall time (s)", "test_accuracy", "test accuracy"),
    "accuracy_vs_epochs.png": ("epoch", "epochs", "test_accuracy", "test accuracy"),
    "loss_vs_time.png": ("wall_s", "training wall time (s)", "loss", "training loss"),
    "loss_vs_epochs.png": ("epoch", "epochs", "loss", "training loss"),
    "samples_per_s_vs_time.png": ("wall_s", "training wall time (s)", "samples_per_s", "training samples/s"),
}


def figures(runs: Mapping[str, Sequence[dict[str, Any]]], *, title: str = "") -> dict[str, Figure]:
    """The figures of :data:`PLOTS` for ``runs`` (label -> records), by file name."""
    try:
        import matplotlib
    except ImportError:
        raise InputError("plots need matplotlib: pip install 'mpisolve[train]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = {}
    for filename, (x_key, x_label, y_key, y_label) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name, records in runs.items():
            points = [(r[x_key], r[y_key]) for r in records if r.get(x_key) is not None and r.get(y_key) is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", markersize=3, label=name)
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        ax.grid(alpha=0.3)
        if title:
            ax.set_title(title)
        if ax.lines:
            ax.legend()
        fig.tight_layout()
        drawn[filename] = fig
    return drawn


def plot_runs(runs: Mapping[str, Sequence[dict[str, Any]]], out: str | Path, *, title: str = "") -> list[Path]:
    """Write the plots of ``runs`` (label -> records) into ``out`` as PNGs; returns their paths."""
    drawn = figures(runs, title=title)
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for filename, fig in drawn.items():
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
