"""Summarise the ABS-SGD ablation (perf/abs_sgd_ablation.sh): OUT/ablation.csv and OUT/ablation.md.

Reads ``OUT/<variant>/<cell>/seed<k>/abs-sgd.summary.json``, the variant naming each
factor's setting (``prediction1.5-momentum_true-lr_none-bounded_1``; the prediction column
gives c). Per variant and cell:
the seeds that reached the target, the median epochs to it (a miss counting as infinitely
long: "miss" when half the seeds or more missed), the median best and final test accuracy
(a best well above the final one is a run that diverged after it), each seed's epochs to
the target (or its final accuracy), the median
number of updates in the run and the mean global batch of an update (samples over
updates, median over the seeds). Usage: ``python perf/abs_sgd_ablation_report.py OUT``.
"""

from __future__ import annotations

import csv
import json
import math
import re
import statistics
import sys
from pathlib import Path

VARIANT = re.compile(r"prediction(?P<p>[0-9.]+)-momentum_(?P<m>true|false)-lr_(?P<lr>\w+)-bounded_(?P<b>\w+)$")
CELL = re.compile(r"(?P<cluster>[a-z-]+)-(?P<mode>real|emulated)-b(?P<batch>\d+)-lr(?P<lr>[0-9.]+)$")


#: The solver's defaults, as the table's columns name them: its first row, the others by how far they are from it.
DEFAULTS = {"prediction": "c=1.5", "momentum correction": "on", "batch-proportional lr": "off", "bounded rounds": "on"}


def changes(row: dict) -> int:
    """How many factors a variant switches from the defaults."""
    return sum(row[k] != v for k, v in DEFAULTS.items())


def on(flag: bool) -> str:
    return "on" if flag else "off"


def best_accuracy(summary: Path) -> float:
    """The highest test accuracy of a run's evaluations (its metrics beside its summary)."""
    records = (json.loads(line) for line in summary.with_name("abs-sgd.jsonl").read_text().splitlines())
    return max(r["test_accuracy"] for r in records if r.get("test_accuracy") is not None)


def per_seed(run: dict) -> str:
    """A run's epochs to the target, or "miss" and its final accuracy."""
    epochs = run["epochs_to_target"]
    return f"miss ({run['final_accuracy']:.3f})" if epochs is None else f"{epochs:.2f}"


def main(out: str) -> int:
    root = Path(out)
    rows = []
    for variant_dir in sorted(root.iterdir()):
        variant = VARIANT.match(variant_dir.name)
        if not variant or not variant_dir.is_dir():
            continue
        for cell_dir in sorted(variant_dir.iterdir()):
            cell = CELL.match(cell_dir.name)
            if not cell or not cell_dir.is_dir():
                continue
            paths = sorted(cell_dir.glob("seed*/abs-sgd.summary.json"))
            runs = [json.loads(p.read_text()) for p in paths]
            if not runs:
                continue
            epochs = statistics.median(
                math.inf if r["epochs_to_target"] is None else r["epochs_to_target"] for r in runs
            )
            train_size = runs[0]["samples_per_s"] * runs[0]["wall_s"] / runs[0]["epochs"]  # samples in an epoch
            rows.append(
                {
                    "prediction": f"c={float(variant['p']):g}" if float(variant["p"]) > 0 else "off",
                    "momentum correction": on(variant["m"] == "true"),
                    "batch-proportional lr": on(variant["lr"] != "none"),
                    "bounded rounds": on(variant["b"] != "none"),
                    "compute": cell["mode"],
                    "seeds": len(runs),
                    "reached": sum(r["time_to_target_s"] is not None for r in runs),
                    "epochs to target": None if math.isinf(epochs) else epochs,
                    "per seed": ", ".join(per_seed(r) for r in runs),
                    "best accuracy": statistics.median(best_accuracy(p) for p in paths),
                    "final accuracy": statistics.median(r["final_accuracy"] for r in runs),
                    "updates": statistics.median(r["steps"] for r in runs),
                    "global batch": statistics.median(r["epochs"] * train_size / max(r["steps"], 1) for r in runs),
                }
            )
    if not rows:
        print(f"no results under {root}", file=sys.stderr)
        return 1
    rows.sort(key=lambda r: (r["compute"] != "real", changes(r), [r[k] != v for k, v in DEFAULTS.items()]))
    with (root / "ablation.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        "| prediction | momentum correction | batch-proportional lr | bounded rounds | compute | reached | "
        "epochs to target | per seed | best accuracy | final accuracy | updates | global batch |",
        "| --- " * 12 + "|",
    ]
    for r in rows:
        epochs = r["epochs to target"]
        cells = [r[k] for k in list(r)[:5]] + [
            f"{r['reached']}/{r['seeds']}",
            "miss" if epochs is None else f"{epochs:.2f}",
            r["per seed"],
            f"{r['best accuracy']:.3f}",
            f"{r['final accuracy']:.3f}",
            f"{r['updates']:.0f}",
            f"{r['global batch']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    (root / "ablation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "perf/results/abs_sgd_ablation"))
