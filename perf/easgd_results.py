"""Merge the pieces of perf/easgd.sh into one table: results.csv and results.json.

Write-up, figures and provenance: docs/studies/easgd-async.md.

``python perf/easgd_results.py DIR`` reads ``DIR/<workload>/<piece>/summary.json`` (the
``compare`` runs) and ``DIR/<workload>/advise.json``, and writes ``DIR/results.csv`` (one
row per workload, seed and solver: time to target, samples per second, final accuracy,
busy fraction, the largest fraction of device overruns on any rank, and the time to
target of allreduce with the same seed divided by the solver's) and ``DIR/results.json``
(the same rows, each workload's settings and advise figures, and per workload and solver
the median over seeds of the time to target, a run that did not reach the target counting
as slower than any that did, and of the speedups measured).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys
from pathlib import Path

FIELDS = (
    "workload",
    "seed",
    "solver",
    "time_to_target_s",
    "samples_per_s",
    "final_accuracy",
    "busy_fraction",
    "max_device_overruns",
    "speedup_vs_allreduce",
)


def _median(values: list[float | None]) -> float | None:
    """The median, a missing value (target not reached) counting as infinitely slow."""
    if not values:
        return None
    m = statistics.median([math.inf if v is None else v for v in values])
    return None if math.isinf(m) else m


def _solver_summary(path: Path, brief: dict) -> dict:
    """A solver's full summary (``train``'s, with the device overruns), else the compare table's entry."""
    return json.loads(path.read_text()) if path.exists() else brief


def merge(out: Path) -> dict:
    rows, workloads, medians = [], {}, []
    for directory in sorted(p for p in out.iterdir() if p.is_dir()):
        pieces = {s.parent.name: json.loads(s.read_text()) for s in sorted(directory.glob("*/summary.json"))}
        if not pieces:
            continue
        by_seed: dict[int, dict[str, dict]] = {}
        for piece_name, piece in pieces.items():
            solvers = {
                name: _solver_summary(directory / piece_name / f"{name}.summary.json", brief)
                for name, brief in piece["solvers"].items()
            }
            by_seed.setdefault(piece["workload"]["seed"], {}).update(solvers)
        for seed, solvers in sorted(by_seed.items()):
            baseline = solvers.get("allreduce", {}).get("time_to_target_s")
            for name, s in solvers.items():
                tta = s["time_to_target_s"]
                speedup = baseline / tta if baseline is not None and tta is not None else None
                overruns = max(s.get("device_overruns") or [0.0])
                rows.append(
                    {
                        **s,
                        "workload": directory.name,
                        "seed": seed,
                        "solver": name,
                        "max_device_overruns": overruns,
                        "speedup_vs_allreduce": speedup,
                    }
                )
        names = dict.fromkeys(r["solver"] for r in rows if r["workload"] == directory.name)
        for name in names:
            mine = [r for r in rows if r["workload"] == directory.name and r["solver"] == name]
            speedups = [r["speedup_vs_allreduce"] for r in mine]
            medians.append(
                {
                    "workload": directory.name,
                    "solver": name,
                    "seeds": [r["seed"] for r in mine],
                    "times_to_target_s": [r["time_to_target_s"] for r in mine],
                    "median_time_to_target_s": _median([r["time_to_target_s"] for r in mine]),
                    "speedups_vs_allreduce": speedups,
                    "median_speedup_vs_allreduce": _median([v for v in speedups if v is not None]),
                    "median_samples_per_s": statistics.median([r["samples_per_s"] for r in mine]),
                }
            )
        advise = directory / "advise.json"
        first = next(iter(pieces.values()))
        workloads[directory.name] = {
            "pieces": {name: piece["workload"] for name, piece in pieces.items()},
            "target_accuracy": first["target_accuracy"],
            "ranks": first["ranks"],
            "advise": json.loads(advise.read_text()) if advise.exists() else None,
        }
    return {"rows": rows, "medians": medians, "workloads": workloads}


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:6.2f} s"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def main(out: Path) -> None:
    result = merge(out)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(result["rows"])
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    for row in result["rows"]:
        speedup = row["speedup_vs_allreduce"]
        print(
            f"{row['workload']:4s} seed {row['seed']} {row['solver']:13s} "
            f"time to target {_seconds(row['time_to_target_s'])}"
            f"  {row['samples_per_s']:7.0f} samples/s  final acc {row['final_accuracy']:.4f}"
            f"  overruns <= {row['max_device_overruns']:.2f}  vs allreduce {_ratio(speedup)}"
        )
    for m in result["medians"]:
        if len(m["seeds"]) > 1:
            print(
                f"{m['workload']:4s} median of {len(m['seeds'])} seeds {m['solver']:13s} time to target"
                f" {_seconds(m['median_time_to_target_s'])}"
                f"  speedup vs allreduce {_ratio(m['median_speedup_vs_allreduce'])}"
                f"  (each: {', '.join(_ratio(v) for v in m['speedups_vs_allreduce'])})"
            )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "perf/results/easgd"))
