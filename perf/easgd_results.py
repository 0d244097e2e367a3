"""Merge the pieces of perf/easgd.sh into one table: results.csv and results.json.

``python perf/easgd_results.py DIR`` reads ``DIR/<workload>/<piece>/summary.json`` (the
``compare`` runs) and ``DIR/<workload>/advise.json``, and writes ``DIR/results.csv`` (one
row per workload and solver: time to target, samples per second, final accuracy, busy
fraction, and the time to target of allreduce divided by the solver's) and
``DIR/results.json`` (the same rows, each workload's settings and advise figures).
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

FIELDS = (
    "workload", "solver", "time_to_target_s", "samples_per_s", "final_accuracy", "busy_fraction", "speedup_vs_allreduce",
)


def merge(out: Path) -> dict:
    rows, workloads = [], {}
    for directory in sorted(p for p in out.iterdir() if p.is_dir()):
        pieces = [json.loads(s.read_text()) for s in sorted(directory.glob("*/summary.json"))]
        if not pieces:
            continue
        solvers = {name: s for piece in pieces for name, s in piece["solvers"].items()}
        baseline = solvers.get("allreduce", {}).get("time_to_target_s")
        for name, s in solvers.items():
            tta = s["time_to_target_s"]
            speedup = baseline / tta if baseline is not None and tta is not None else None
            rows.append({"workload": directory.name, "solver": name, **s, "speedup_vs_allreduce": speedup})
        advise = directory / "advise.json"
        workloads[directory.name] = {
            "pieces": {p.parent.name: json.loads(p.read_text())["workload"] for p in sorted(directory.glob("*/summary.json"))},
            "target_accuracy": pieces[0]["target_accuracy"],
            "ranks": pieces[0]["ranks"],
            "advise": json.loads(advise.read_text()) if advise.exists() else None,
        }
    return {"rows": rows, "workloads": workloads}


def main(out: Path) -> None:
    result = merge(out)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(result["rows"])
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    for row in result["rows"]:
        tta, speedup = row["time_to_target_s"], row["speedup_vs_allreduce"]
        print(
            f"{row['workload']:4s} {row['solver']:13s} time to target "
            f"{'-' if tta is None else f'{tta:6.2f} s'}  {row['samples_per_s']:7.0f} samples/s  "
            f"final acc {row['final_accuracy']:.4f}  vs allreduce {'-' if speedup is None else f'{speedup:.2f}x'}"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "perf/results/easgd"))
