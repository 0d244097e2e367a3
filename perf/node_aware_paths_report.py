"""The path-selection table of docs/studies/node-aware.md from the runs under perf/results/node_aware/paths/.

Each run directory holds one ``bench sweep`` JSON per layout (``sweep_<layout>.json``); for
every layout, size and operation this prints the median over the runs of the operation's
latency over flat MPI's (measured in the same run and repeat, so the ratios hold where the
absolute times do not), each run's ratio after it, and bold where the median is no slower.

    python perf/node_aware_paths_report.py RUN [RUN ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent / "results" / "node_aware" / "paths"
LAYOUTS = ("n2", "n4", "n8", "2x2", "2x3")
OPS = ("bucketed", "sum")


def main(runs: list[str]) -> None:
    header = "| bytes | " + " | ".join(f"{op}, {layout}" for layout in LAYOUTS for op in OPS) + " |"
    print(header)
    print("| --- " * (1 + len(LAYOUTS) * len(OPS)) + "|")
    results = {
        (run, layout): json.loads((ROOT / run / f"sweep_{layout}.json").read_text())
        for run in runs
        for layout in LAYOUTS
    }
    sizes = sorted({int(s) for r in results.values() for s in r["ratios"]["sum"]})
    for size in sizes:
        cells = []
        for layout in LAYOUTS:
            for op in OPS:
                ratios = [results[run, layout]["ratios"][op][str(size)] for run in runs]
                median = statistics.median(ratios)
                text = f"{median:.2f}x"
                cells.append((f"**{text}**" if median <= 1 else text) + f" ({' / '.join(f'{r:.2f}' for r in ratios)})")
        print(f"| {size:,} | " + " | ".join(cells) + " |")
    for run in runs:
        loads = {layout: results[run, layout]["load_average"] for layout in LAYOUTS}
        print(
            f"\n{run}: load average before/after " + ", ".join(f"{k} {v[0]:.1f}/{v[1]:.1f}" for k, v in loads.items())
        )


if __name__ == "__main__":
    main(sys.argv[1:])
