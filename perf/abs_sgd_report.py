"""Summarise the ABS-SGD study (perf/abs_sgd.sh): results.csv, results.json, table.md and abs_sgd.png.

Reads ``OUT/<model>-<preset>/`` (one ``mpisolve compare`` output per model and cluster)
and reports, per model and preset, each solver's time to the target accuracy, ABS-SGD's
speedup over the best baseline that reached it, every rank's busy fraction and how often
a micro-batch overran its emulated device; then the mean speedup over the three
heterogeneous presets and ABS-SGD's loss against synchronous SGD on the homogeneous
cluster. ``table.md`` is the README's table. Usage: ``python perf/abs_sgd_report.py OUT``.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

MODELS = {"mlp": "MLP on digits"}
PRESETS = ("homogeneous", "straggler", "two-tier", "graded")
SOLVERS = ("abs-sgd", "allreduce", "lb-bsp", "async-sgd", "local-sgd")
BASELINES = SOLVERS[1:]


def load(out: Path) -> list[dict]:
    rows = []
    for model in MODELS:
        for preset in PRESETS:
            directory = out / f"{model}-{preset}"
            if not (directory / "summary.json").exists():
                continue
            for solver in SOLVERS:
                path = directory / f"{solver}.summary.json"
                if not path.exists():
                    continue
                s = json.loads(path.read_text())
                rows.append(
                    {
                        "model": model,
                        "preset": preset,
                        "solver": solver,
                        "target_accuracy": s["target_accuracy"],
                        "time_to_target_s": s["time_to_target_s"],
                        "epochs_to_target": s.get("epochs_to_target"),
                        "final_accuracy": s["final_accuracy"],
                        "updates": s["steps"],
                        "epochs": s["epochs"],
                        "wall_s": s["wall_s"],
                        "samples_per_s": s["samples_per_s"],
                        "busy": s["busy"],
                        "samples_by_rank": s["samples_by_rank"],
                        "batch_sizes": s["batch_sizes"],
                        "device_overruns": s.get("device_overruns"),
                    }
                )
    return rows


def verdicts(rows: list[dict]) -> dict:
    """Per model and preset: ABS-SGD's time, the best baseline's, the speedup; then the means."""
    out: dict = {}
    for model in MODELS:
        cells = {}
        for preset in PRESETS:
            runs = {r["solver"]: r for r in rows if r["model"] == model and r["preset"] == preset}
            if "abs-sgd" not in runs:
                continue
            reached = {n: r["time_to_target_s"] for n, r in runs.items() if n in BASELINES and r["time_to_target_s"] is not None}
            best = min(reached, key=reached.get) if reached else None
            abs_time = runs["abs-sgd"]["time_to_target_s"]
            cells[preset] = {
                "abs_sgd_s": abs_time,
                "best_baseline": best,
                "best_baseline_s": reached.get(best),
                "speedup": (reached[best] / abs_time) if (best and abs_time) else None,
                "abs_sgd_busy": runs["abs-sgd"]["busy"],
                "abs_sgd_min_busy": min(runs["abs-sgd"]["busy"]),
                "times": {n: r["time_to_target_s"] for n, r in runs.items()},
                "max_overrun": max(max(r["device_overruns"] or [0.0]) for r in runs.values()),
            }
            if "allreduce" in runs and runs["allreduce"]["time_to_target_s"] and abs_time:
                cells[preset]["vs_sync"] = runs["allreduce"]["time_to_target_s"] / abs_time
        hetero = [cells[p]["speedup"] for p in PRESETS[1:] if p in cells and cells[p]["speedup"] is not None]
        out[model] = {
            "presets": cells,
            "mean_speedup_heterogeneous": sum(hetero) / len(hetero) if len(hetero) == 3 else None,
            "homogeneous_loss_vs_sync": (1 / cells["homogeneous"]["vs_sync"] - 1) if cells.get("homogeneous", {}).get("vs_sync") else None,
        }
    return out


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "preset", "solver", "target_accuracy", "time_to_target_s", "epochs_to_target", "final_accuracy", "updates",
                    "epochs", "samples_per_s", "busy_r0", "busy_r1", "busy_r2", "busy_r3", "samples_by_rank", "batch_sizes",
                    "device_overruns"])
        for r in rows:
            t, e = r["time_to_target_s"], r["epochs_to_target"]
            w.writerow([r["model"], r["preset"], r["solver"], r["target_accuracy"], "" if t is None else f"{t:.2f}",
                        "" if e is None else f"{e:.2f}",
                        f"{r['final_accuracy']:.4f}", r["updates"], f"{r['epochs']:.2f}", f"{r['samples_per_s']:.0f}",
                        *(f"{b:.3f}" for b in r["busy"]), " ".join(map(str, r["samples_by_rank"])),
                        " ".join(map(str, r["batch_sizes"])), " ".join(f"{o:.2f}" for o in r["device_overruns"] or [])])


def write_table(summary: dict, path: Path) -> None:
    """The README's table: per cluster, every solver's time to target, the speedup, ABS-SGD's busy fractions."""
    lines = []
    for v in summary.values():
        lines.append("| cluster | " + " | ".join(SOLVERS) + " | abs-sgd vs best baseline | abs-sgd busy per rank | overruns (max) |")
        lines.append("| --- " * (len(SOLVERS) + 4) + "|")
        for preset, c in v["presets"].items():
            times = ["-" if n not in c["times"] else "not reached" if c["times"][n] is None else f"{c['times'][n]:.2f}" for n in SOLVERS]
            speedup = "-" if c["speedup"] is None else f"{c['speedup']:.2f}x ({c['best_baseline']})"
            busy = " ".join(f"{b:.2f}" for b in c["abs_sgd_busy"])
            lines.append(f"| {preset} | " + " | ".join(times) + f" | {speedup} | {busy} | {c['max_overrun']:.2f} |")
    path.write_text("\n".join(lines) + "\n")


def plot(rows: list[dict], path: Path) -> None:
    """Top: time to target per preset and solver (x: not reached). Bottom: the least busy rank's busy fraction."""
    models = {m: t for m, t in MODELS.items() if any(r["model"] == m for r in rows)}
    fig, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 7.5), squeeze=False)
    width = 0.16
    for col, (model, title) in enumerate(models.items()):
        for row, (key, label) in enumerate((("time_to_target_s", "time to target (s)"), ("busy", "least busy rank's busy fraction"))):
            ax = axes[row][col]
            for k, solver in enumerate(SOLVERS):
                xs, ys, missed = [], [], []
                for i, preset in enumerate(PRESETS):
                    match = [r for r in rows if (r["model"], r["preset"], r["solver"]) == (model, preset, solver)]
                    if match and match[0][key] is not None:
                        xs.append(i + (k - 2) * width)
                        ys.append(min(match[0][key]) if key == "busy" else match[0][key])
                    elif match:
                        missed.append(i + (k - 2) * width)
                ax.bar(xs, ys, width, label=solver, color=f"C{k}")
                ax.plot(missed, [0] * len(missed), "x", color=f"C{k}", markersize=8)  # target not reached
            ax.set_xticks(range(len(PRESETS)), PRESETS)
            ax.set_ylabel(label)
            target = next((r["target_accuracy"] for r in rows if r["model"] == model), None)
            ax.set_title(f"{title}: time to {target} accuracy (x: not reached)" if row == 0 else title, fontsize=10)
            if row == 1:
                ax.axhline(0.95, color="grey", linestyle=":", linewidth=1)
                ax.set_ylim(0, 1.05)
            ax.grid(True, axis="y", alpha=0.3)
    # Built by hand: a solver that reached the target nowhere has no bar to take its colour from.
    axes[0][0].legend(handles=[Patch(color=f"C{k}", label=solver) for k, solver in enumerate(SOLVERS)], fontsize=8)
    fig.suptitle("ABS-SGD and baselines, 4 ranks on emulated devices", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(out: str) -> int:
    root = Path(out)
    rows = load(root)
    if not rows:
        print(f"no results under {root}", file=sys.stderr)
        return 1
    summary = verdicts(rows)
    write_csv(rows, root / "results.csv")
    (root / "results.json").write_text(json.dumps({"runs": rows, "verdicts": summary}, indent=1) + "\n")
    write_table(summary, root / "table.md")
    plot(rows, root / "abs_sgd.png")
    for model, v in summary.items():
        print(f"== {MODELS[model]}")
        print(f"{'preset':12} {'abs-sgd (s)':>11} {'best baseline':>22} {'speedup':>8} {'abs-sgd busy per rank'}")
        for preset, c in v["presets"].items():
            abs_s = "-" if c["abs_sgd_s"] is None else f"{c['abs_sgd_s']:.2f}"
            best = "-" if c["best_baseline"] is None else f"{c['best_baseline']} {c['best_baseline_s']:.2f}"
            speedup = "-" if c["speedup"] is None else f"{c['speedup']:.2f}x"
            busy = " ".join(f"{b:.2f}" for b in c["abs_sgd_busy"])
            print(f"{preset:12} {abs_s:>11} {best:>22} {speedup:>8} {busy}")
        mean, loss = v["mean_speedup_heterogeneous"], v["homogeneous_loss_vs_sync"]
        print(f"mean speedup over the three heterogeneous presets: {'-' if mean is None else f'{mean:.2f}x'}; "
              f"homogeneous, abs-sgd vs allreduce: {'-' if loss is None else f'{100 * loss:+.0f}% time'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "perf/results/abs_sgd"))
