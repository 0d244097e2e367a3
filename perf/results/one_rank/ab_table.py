"""Tabulate ab-de746d0.sh's runs: each solver's solver_over_plain, per run (markdown on stdout).

``python ab_table.py [--dir DIR] LABEL...`` (DIR: the script's $OUT, default this directory).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent


def ratios(where: Path, label: str) -> dict[str, float]:
    rows = [json.loads(line) for line in (where / f"cpu-mlp-2026-11-29-{label}.jsonl").read_text().splitlines()]
    return {row["solver"]: row["solver_over_plain"] for row in rows if "solver" in row}


def main() -> None:
    args = sys.argv[1:]
    where = HERE
    if args[:1] == ["--dir"]:
        where, args = Path(args[1]), args[2:]
    labels = args
    runs = {label: ratios(where, label) for label in labels}
    solvers = sorted(next(iter(runs.values())))
    print("| solver | " + " | ".join(labels) + " |")
    print("| --- |" + " --- |" * len(labels))
    for name in solvers:
        print(f"| `{name}` | " + " | ".join(f"{runs[label][name]:.3f}" for label in labels) + " |")
    for label in labels:
        values = [v for k, v in runs[label].items() if k != "kfac"]
        print(f"{label}: all but kfac, median {statistics.median(values):.3f}, max {max(values):.3f}", file=sys.stderr)


if __name__ == "__main__":
    main()
