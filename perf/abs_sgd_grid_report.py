"""Summarise the ABS-SGD convergence grid (perf/abs_sgd_grid.sh): OUT/grid.csv and OUT/grid.md.

Reads ``OUT/<cluster>-<mode>-b<batch>-lr<lr>/seed<k>/`` (each an ``mpisolve compare``
output) from every OUT given; a later OUT's runs of a solver replace an earlier one's for
the same cell and seed (so a re-run of ``abs-sgd`` alone can be read beside the grid's
``allreduce``). Per cell and solver: the seeds that reached the target, the median epochs
to it (a miss counting as infinitely long) and the slowest seed's, the median final
accuracy, the largest share of emulated-device overruns; grid.csv also has the median wall
time to the target, read under the shared CPU lock (a convergence check, not a timing). Prints
every (cell, seed) where ``allreduce`` reached the target and ``abs-sgd`` did not, and
exits 1 if there is one. Usage: ``python perf/abs_sgd_grid_report.py OUT [OUT ...]``
(grid.csv and grid.md go to the last OUT).
"""

from __future__ import annotations

import csv
import json
import math
import re
import statistics
import sys
from pathlib import Path

CELL = re.compile(r"(?P<cluster>[a-z-]+)-(?P<mode>real|emulated)-b(?P<batch>\d+)-lr(?P<lr>[0-9.]+)$")
SOLVERS = ("abs-sgd", "allreduce")
CLUSTERS = ("homogeneous", "straggler", "two-tier", "graded")  # the table's order; others after
MODES = ("real", "emulated")


def load(outs: list[Path]) -> dict[tuple, dict]:
    """(cluster, mode, batch, lr, seed, solver) -> that run's summary."""
    runs: dict[tuple, dict] = {}
    for out in outs:
        for cell_dir in sorted(out.iterdir()):
            match = CELL.match(cell_dir.name)
            if not match or not cell_dir.is_dir():
                continue
            cell = (match["cluster"], match["mode"], int(match["batch"]), float(match["lr"]))
            for seed_dir in sorted(cell_dir.glob("seed*")):
                for solver in SOLVERS:
                    path = seed_dir / f"{solver}.summary.json"
                    if path.exists():
                        runs[(*cell, int(seed_dir.name[4:]), solver)] = json.loads(path.read_text())
    return runs


def epochs_key(epochs: float | None) -> float:
    """Epochs to target as a sort key, a miss last."""
    return math.inf if epochs is None else epochs


def median(values: list[float | None]) -> float | None:
    """The median, a None (a miss) counting as infinitely long; None if that is a miss."""
    if not values:
        return None
    m = statistics.median(math.inf if v is None else v for v in values)
    return None if math.isinf(m) else m


def order(cell: tuple) -> tuple:
    """Real compute first, then the clusters in CLUSTERS' order, then batch and lr."""
    cluster, mode = cell[0], cell[1]
    known = CLUSTERS.index(cluster) if cluster in CLUSTERS else len(CLUSTERS)
    return (MODES.index(mode), known, cluster, *cell[2:])


def main(outs: list[str]) -> int:
    roots = [Path(o) for o in outs]
    runs = load(roots)
    if not runs:
        print(f"no results under {', '.join(outs)}", file=sys.stderr)
        return 1
    cells = sorted({key[:4] for key in runs}, key=order)
    rows, failures = [], []
    for cell in cells:
        seeds = sorted({key[4] for key in runs if key[:4] == cell})
        row: dict = dict(zip(("cluster", "mode", "batch", "lr"), cell))
        for solver in SOLVERS:
            mine = [runs.get((*cell, s, solver)) for s in seeds]
            done = [r for r in mine if r is not None]
            row[f"{solver} reached"] = f"{sum(r['time_to_target_s'] is not None for r in done)}/{len(done)}"
            row[f"{solver} epochs"] = median([r["epochs_to_target"] for r in done])
            row[f"{solver} slowest epochs"] = max((r["epochs_to_target"] for r in done), key=epochs_key, default=None)
            # wall seconds under the shared CPU lock: not a timing (docs/studies/abs-sgd.md)
            row[f"{solver} time_s shared lock"] = median([r["time_to_target_s"] for r in done])
            row[f"{solver} final"] = statistics.median(r["final_accuracy"] for r in done) if done else None
            row[f"{solver} overruns"] = max((max(r["device_overruns"] or [0.0]) for r in done), default=None)
        for s in seeds:
            sync, mine = runs.get((*cell, s, "allreduce")), runs.get((*cell, s, "abs-sgd"))
            if sync and mine and sync["time_to_target_s"] is not None and mine["time_to_target_s"] is None:
                failures.append((*cell, s, mine["final_accuracy"]))
        rows.append(row)
    last = roots[-1]
    with (last / "grid.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        "| cluster | compute | batch | lr | allreduce reached | abs-sgd reached | median epochs to target: allreduce | "
        "abs-sgd | abs-sgd's slowest seed | abs-sgd final accuracy | overruns (max): allreduce | abs-sgd |",
        "| --- " * 12 + "|",
    ]

    def fmt(x: float | None, digits: int = 2) -> str:
        return "miss" if x is None else f"{x:.{digits}f}"

    for r in rows:
        lines.append(
            f"| {r['cluster']} | {r['mode']} | {r['batch']} | {r['lr']:g} | {r['allreduce reached']} | "
            f"{r['abs-sgd reached']} | {fmt(r['allreduce epochs'])} | {fmt(r['abs-sgd epochs'])} | "
            f"{fmt(r['abs-sgd slowest epochs'])} | {fmt(r['abs-sgd final'], 3)} | "
            f"{fmt(r['allreduce overruns'])} | {fmt(r['abs-sgd overruns'])} |"
        )
    (last / "grid.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    both = sum(1 for key in runs if key[5] == "allreduce" and runs[key]["time_to_target_s"] is not None)
    print(f"\nruns where allreduce reached the target: {both}; of those, abs-sgd missed it in {len(failures)}")
    for cluster, mode, batch, lr, seed, final in failures:
        print(f"  abs-sgd missed: {cluster} {mode} batch {batch} lr {lr:g} seed {seed} (final accuracy {final:.3f})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["perf/results/abs_sgd_grid"]))
