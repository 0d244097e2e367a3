"""Summarise the ABS-SGD regime sweeps (perf/abs_sgd_regimes.sh): OUT/regimes.csv, regimes.md, regimes.png.

Reads ``OUT/<sweep>-<point>/seed<k>/`` (``mpisolve compare`` outputs) and reports, per sweep
and point, each solver's median time to the target over the seeds (a miss counting as
infinitely long), ABS-SGD's speedup over LB-BSP by those medians, and LB-BSP's blocked
share of the training time (the allreduce's share of its step, waits included; mean over
ranks, median over seeds). The figure has one panel per sweep: median time to target
against the point, a bar from the fastest to the slowest seed.
Usage: ``python perf/abs_sgd_regimes.py OUT``.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SOLVERS = ("abs-sgd", "lb-bsp", "allreduce")
SWEEPS = {
    "moving": "the 4x straggler moves every S seconds",
    "drift": "each speed slides into the next rank's over S seconds",
    "comm": "emulated device, ms per sample (shorter: the allreduce a larger share)",
}


def point_key(point: str) -> float:
    return math.inf if point == "static" else float(point)


def median(values: list[float | None]) -> float | None:
    m = statistics.median(math.inf if v is None else v for v in values)
    return None if math.isinf(m) else m


def main(out: str) -> int:
    root = Path(out)
    rows = []
    for point_dir in sorted(root.iterdir()):
        sweep, _, point = point_dir.name.partition("-")
        if sweep not in SWEEPS or not point_dir.is_dir():
            continue
        runs = {s: [] for s in SOLVERS}
        for seed_dir in sorted(point_dir.glob("seed*")):
            for solver in SOLVERS:
                path = seed_dir / f"{solver}.summary.json"
                if path.exists():
                    runs[solver].append(json.loads(path.read_text()))
        if not runs["abs-sgd"]:
            continue
        row: dict = {"sweep": sweep, "point": point, "seeds": len(runs["abs-sgd"])}
        for solver, summaries in runs.items():
            times = [r["time_to_target_s"] for r in summaries]
            row[f"{solver} s"] = median(times) if times else None
            row[f"{solver} min s"] = min((t for t in times if t is not None), default=None)
            row[f"{solver} max s"] = max((math.inf if t is None else t for t in times), default=None)
        abs_s, lb_s = row["abs-sgd s"], row["lb-bsp s"]
        row["abs-sgd vs lb-bsp"] = lb_s / abs_s if abs_s and lb_s else None
        row["lb-bsp comm share"] = (
            statistics.median(sum(r["comm"]) / len(r["comm"]) for r in runs["lb-bsp"]) if runs["lb-bsp"] else None
        )
        row["max overrun"] = max(max(r["device_overruns"] or [0.0]) for rs in runs.values() for r in rs)
        rows.append(row)
    if not rows:
        print(f"no results under {root}", file=sys.stderr)
        return 1
    rows.sort(key=lambda r: (r["sweep"], point_key(r["point"])))
    with (root / "regimes.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    def fmt(x: float | None, pattern: str = "{:.2f}") -> str:
        return "miss" if x is None else pattern.format(x)

    lines = [
        "| sweep | point | seeds | abs-sgd (s) | lb-bsp (s) | allreduce (s) | abs-sgd vs lb-bsp | "
        "lb-bsp comm share | overruns (max) |",
        "| --- " * 9 + "|",
    ]
    for r in rows:
        lines.append(
            f"| {r['sweep']} | {r['point']} | {r['seeds']} | {fmt(r['abs-sgd s'])} | {fmt(r['lb-bsp s'])} | "
            f"{fmt(r['allreduce s'])} | {fmt(r['abs-sgd vs lb-bsp'], '{:.2f}x')} | {fmt(r['lb-bsp comm share'])} | "
            f"{r['max overrun']:.2f} |"
        )
    (root / "regimes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    sweeps = [s for s in SWEEPS if any(r["sweep"] == s for r in rows)]
    fig, axes = plt.subplots(1, len(sweeps), figsize=(6 * len(sweeps), 4.2), squeeze=False)
    for ax, sweep in zip(axes[0], sweeps):
        mine = [r for r in rows if r["sweep"] == sweep]
        labels = [r["point"] for r in mine]
        for k, solver in enumerate(SOLVERS):
            xs = [i + (k - 1) * 0.08 for i in range(len(mine))]
            ys = [r[f"{solver} s"] if r[f"{solver} s"] is not None else math.nan for r in mine]
            low = [y - (r[f"{solver} min s"] or y) for y, r in zip(ys, mine)]
            high = [min(r[f"{solver} max s"] or y, 2 * y) - y for y, r in zip(ys, mine)]
            ax.errorbar(xs, ys, yerr=[low, high], marker="o", capsize=3, label=solver, color=f"C{k}")
        ax.set_xticks(range(len(mine)), labels)
        ax.set_xlabel(SWEEPS[sweep])
        ax.set_ylabel("time to 96% test accuracy (s), median of seeds")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("ABS-SGD against LB-BSP and allreduce: 4 ranks, --hetero straggler, MLP on digits", fontsize=10)
    fig.tight_layout()
    fig.savefig(root / "regimes.png", dpi=110)
    plt.close(fig)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "perf/results/abs_sgd_regimes"))
