"""Summarise the ABS-SGD study (perf/abs_sgd.sh): results.csv, results.json, table.md and abs_sgd.png.

Write-up, figures and provenance: docs/studies/abs-sgd.md.

Reads ``OUT/<model>-<preset>/seed<k>/`` (the ``mpisolve compare`` outputs of a model,
cluster and seed; a solver run in a job of its own is in a folder below) and reports,
per model and preset, each solver's median time to the target accuracy over the seeds
(not reached if it missed in half the seeds or more),
ABS-SGD's speedup over the best baseline by those medians with its range over the seeds,
ABS-SGD's least busy fraction per rank over the seeds and how often a micro-batch overran
its emulated device; then the mean speedup over the three heterogeneous presets (and the
same mean over every baseline but ``lb-bsp``, which is told the speeds in advance) and
ABS-SGD's loss against synchronous SGD on the homogeneous cluster. ``table.md`` is the
study's table. Usage: ``python perf/abs_sgd_report.py OUT``.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

matplotlib.use("Agg")  # figures go to files; pyplot takes the backend at its first figure

MODELS = {"mlp": "MLP on digits"}
PRESETS = ("homogeneous", "straggler", "two-tier", "graded", "moving-straggler")
HETERO_PRESETS = PRESETS[1:4]  # the three heterogeneous clusters: the mean speedup is over these
SOLVERS = ("abs-sgd", "allreduce", "lb-bsp", "async-sgd", "local-sgd")
BASELINES = SOLVERS[1:]


def load(out: Path) -> list[dict]:
    rows = []
    for model in MODELS:
        for preset in PRESETS:
            for directory in sorted((out / f"{model}-{preset}").glob("seed*")):
                if not (directory / "summary.json").exists():
                    continue
                for solver in SOLVERS:
                    path = next(directory.rglob(f"{solver}.summary.json"), None)  # a solver may run in a job of its own
                    if path is None:
                        continue
                    s = json.loads(path.read_text())
                    rows.append(
                        {
                            "model": model,
                            "preset": preset,
                            "seed": s["workload"]["seed"],
                            "solver": solver,
                            "lr": s["workload"]["lr"],
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


def median_time(times: list[float | None]) -> float | None:
    """The median time to target over the seeds, a miss counting as infinitely long; None if that is a miss."""
    median = statistics.median(math.inf if t is None else t for t in times)
    return None if math.isinf(median) else median


def verdicts(rows: list[dict]) -> dict:
    """Per model and preset: every solver's median time, ABS-SGD's speedup over the best baseline; then the means."""
    out: dict = {}
    for model in MODELS:
        cells = {}
        for preset in PRESETS:
            runs = [r for r in rows if r["model"] == model and r["preset"] == preset]
            by_solver = {n: [r for r in runs if r["solver"] == n] for n in SOLVERS}
            if not by_solver["abs-sgd"]:
                continue
            times = {n: median_time([r["time_to_target_s"] for r in rs]) for n, rs in by_solver.items() if rs}
            reached = {n: t for n, t in times.items() if n in BASELINES and t is not None}
            best = min(reached, key=reached.get) if reached else None
            abs_time = times["abs-sgd"]
            per_seed = []  # each seed's best baseline over its abs-sgd; None where either missed the target
            for seed in sorted({r["seed"] for r in by_solver["abs-sgd"]}):
                mine = {r["solver"]: r["time_to_target_s"] for r in runs if r["seed"] == seed}
                others = [t for n, t in mine.items() if n in BASELINES and t is not None]
                per_seed.append(min(others) / mine["abs-sgd"] if mine.get("abs-sgd") and others else None)
            busy = [min(col) for col in zip(*(r["busy"] for r in by_solver["abs-sgd"]))]
            cells[preset] = {
                "seeds": len(by_solver["abs-sgd"]),
                "abs_sgd_s": abs_time,
                "best_baseline": best,
                "best_baseline_s": reached.get(best),
                "speedup": (reached[best] / abs_time) if (best and abs_time) else None,
                "speedup_per_seed": per_seed,
                "abs_sgd_busy": busy,
                "abs_sgd_min_busy": min(busy),
                "times": times,
                "max_overrun": max(max(r["device_overruns"] or [0.0]) for r in runs),
            }
            if times.get("allreduce") and abs_time:
                cells[preset]["vs_sync"] = times["allreduce"] / abs_time
        hetero = [cells[p]["speedup"] for p in HETERO_PRESETS if p in cells and cells[p]["speedup"] is not None]
        # The same mean against the paper's kind of baseline only: lb-bsp is told the speeds in advance.
        unaided = []
        for p in HETERO_PRESETS:
            times = cells.get(p, {}).get("times", {})
            others = [t for n, t in times.items() if n in BASELINES and n != "lb-bsp" and t is not None]
            if others and times.get("abs-sgd"):
                unaided.append(min(others) / times["abs-sgd"])
        out[model] = {
            "presets": cells,
            "mean_speedup_heterogeneous": sum(hetero) / len(hetero) if len(hetero) == 3 else None,
            "mean_speedup_heterogeneous_without_lb_bsp": sum(unaided) / len(unaided) if len(unaided) == 3 else None,
            "homogeneous_loss_vs_sync": (1 / cells["homogeneous"]["vs_sync"] - 1)
            if cells.get("homogeneous", {}).get("vs_sync")
            else None,
        }
    return out


def _ratio(x: float | None) -> str:
    return "miss" if x is None else f"{x:.2f}"


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "model",
                "preset",
                "seed",
                "solver",
                "lr",
                "target_accuracy",
                "time_to_target_s",
                "epochs_to_target",
                "final_accuracy",
                "updates",
                "epochs",
                "samples_per_s",
                "busy_r0",
                "busy_r1",
                "busy_r2",
                "busy_r3",
                "samples_by_rank",
                "batch_sizes",
                "device_overruns",
            ]
        )
        for r in rows:
            t, e = r["time_to_target_s"], r["epochs_to_target"]
            w.writerow(
                [
                    r["model"],
                    r["preset"],
                    r["seed"],
                    r["solver"],
                    r["lr"],
                    r["target_accuracy"],
                    "" if t is None else f"{t:.2f}",
                    "" if e is None else f"{e:.2f}",
                    f"{r['final_accuracy']:.4f}",
                    r["updates"],
                    f"{r['epochs']:.2f}",
                    f"{r['samples_per_s']:.0f}",
                    *(f"{b:.3f}" for b in r["busy"]),
                    " ".join(map(str, r["samples_by_rank"])),
                    " ".join(map(str, r["batch_sizes"])),
                    " ".join(f"{o:.2f}" for o in r["device_overruns"] or []),
                ]
            )


def write_table(summary: dict, path: Path) -> None:
    """The study's table: per cluster, every solver's median time to target, the speedup, ABS-SGD's busy fractions."""
    lines = []
    for v in summary.values():
        lines.append(
            "| cluster | seeds | "
            + " | ".join(SOLVERS)
            + " | abs-sgd vs best baseline (per seed) | abs-sgd busy per rank (least) | overruns (max) |"
        )
        lines.append("| --- " * (len(SOLVERS) + 5) + "|")
        for preset, c in v["presets"].items():
            times = [
                "-" if n not in c["times"] else "not reached" if c["times"][n] is None else f"{c['times'][n]:.2f}"
                for n in SOLVERS
            ]
            speedup = "-" if c["speedup"] is None else f"{c['speedup']:.2f}x ({c['best_baseline']})"
            if c["speedup_per_seed"]:
                speedup += " (" + ", ".join(_ratio(x) for x in c["speedup_per_seed"]) + ")"
            busy = " ".join(f"{b:.2f}" for b in c["abs_sgd_busy"])
            lines.append(
                f"| {preset} | {c['seeds']} | "
                + " | ".join(times)
                + f" | {speedup} | {busy} | {c['max_overrun']:.2f} |"
            )
    path.write_text("\n".join(lines) + "\n")


def plot(rows: list[dict], path: Path) -> None:
    """Top: median time to target per preset and solver (x: not reached).

    Bottom: the least busy rank's busy fraction.
    """
    models = {m: t for m, t in MODELS.items() if any(r["model"] == m for r in rows)}
    fig, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 7.5), squeeze=False)
    width = 0.16
    for col, (model, title) in enumerate(models.items()):
        for row, (key, label) in enumerate(
            (("time_to_target_s", "time to target (s)"), ("busy", "least busy rank's busy fraction"))
        ):
            ax = axes[row][col]
            for k, solver in enumerate(SOLVERS):
                xs, ys, missed = [], [], []
                for i, preset in enumerate(PRESETS):
                    match = [r for r in rows if (r["model"], r["preset"], r["solver"]) == (model, preset, solver)]
                    if not match:
                        continue
                    value = (
                        min(min(r["busy"]) for r in match) if key == "busy" else median_time([r[key] for r in match])
                    )
                    if value is None:
                        missed.append(i + (k - 2) * width)
                    else:
                        xs.append(i + (k - 2) * width)
                        ys.append(value)
                ax.bar(xs, ys, width, label=solver, color=f"C{k}")
                ax.plot(missed, [0] * len(missed), "x", color=f"C{k}", markersize=8)  # target not reached
            ax.set_xticks(range(len(PRESETS)), PRESETS)
            ax.set_ylabel(label)
            target = next((r["target_accuracy"] for r in rows if r["model"] == model), None)
            ax.set_title(
                f"{title}: median time to {target} accuracy (x: not reached)" if row == 0 else title, fontsize=10
            )
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
        print(
            f"{'preset':12} {'seeds':>5} {'abs-sgd (s)':>11} {'best baseline':>22} {'speedup':>8} "
            f"{'per seed':>18}  abs-sgd busy per rank (least)"
        )
        for preset, c in v["presets"].items():
            abs_s = "-" if c["abs_sgd_s"] is None else f"{c['abs_sgd_s']:.2f}"
            best = "-" if c["best_baseline"] is None else f"{c['best_baseline']} {c['best_baseline_s']:.2f}"
            speedup = "-" if c["speedup"] is None else f"{c['speedup']:.2f}x"
            per_seed = " ".join(_ratio(x) for x in c["speedup_per_seed"])
            busy = " ".join(f"{b:.2f}" for b in c["abs_sgd_busy"])
            print(f"{preset:12} {c['seeds']:>5} {abs_s:>11} {best:>22} {speedup:>8} {per_seed:>18}  {busy}")
        mean, loss = v["mean_speedup_heterogeneous"], v["homogeneous_loss_vs_sync"]
        unaided = v["mean_speedup_heterogeneous_without_lb_bsp"]
        print(
            f"mean speedup over the three heterogeneous presets: {'-' if mean is None else f'{mean:.2f}x'}; "
            f"homogeneous, abs-sgd vs allreduce: {'-' if loss is None else f'{100 * loss:+.0f}% time'}"
        )
        print(
            "the same mean over every baseline but lb-bsp (told the speeds in advance): "
            f"{'-' if unaided is None else f'{unaided:.2f}x'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "perf/results/abs_sgd"))
