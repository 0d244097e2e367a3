"""Weak scaling of every solver at 1, 2, 4 and 8 ranks: throughput, efficiency, busy/comm/idle.

For each model and rank count, one ``mpisolve compare`` run trains every solver in turn
for ``--steps`` updates at a fixed per-rank batch, one torch thread per rank
(OMP_NUM_THREADS=1, so a rank is one core's worth of compute), plain SGD (momentum 0:
the ``m`` solvers bring their own). From each solver's
metrics log the first record (warm-up) is dropped; the rest give the steady-state
global samples/s and the busy/comm/idle split (mpisolve.train.accounting), averaged
over ranks. Writes, under ``--out`` (default perf/results/scaling)::

    <model>-n<P>/            the compare run's logs and summaries
    scaling.csv              one row per model, solver, ranks
    table.md                 the README's table
    scaling_<model>.png      throughput with the ideal line, efficiency, stacked breakdown

Efficiency is weak scaling's, throughput(P) / (P x throughput(1)); ``cores_efficiency``
divides by min(P, cores) x throughput(1) instead, the most this machine could give.
::

    python perf/scaling.py                                  # everything, then the plots
    python perf/scaling.py --models mlp --ranks 8           # one piece; replots what is there
    python perf/scaling.py --plot-only
    python perf/scaling.py --solvers allreduce,adasum       # default: every registered solver
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from pathlib import Path

from launch import RESULTS, run_mpisolve

OUT = RESULTS / "scaling"
FIELDS = ("model", "solver", "ranks", "batch", "steps", "iteration_s", "samples_per_s", "speedup", "efficiency",
          "cores_efficiency", "busy", "comm", "idle", "load_before", "load_after")


def run_piece(model: str, ranks: int, args: argparse.Namespace) -> None:
    out = args.out / f"{model}-n{ranks}"
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    (out / "load.json").write_text(json.dumps({"before": load_before}) + "\n")
    run_mpisolve(
        ranks,
        ["compare", "--solvers", args.solvers, "--model", model, "--dataset", "digits", "--batch-size", str(args.batch),
         "--momentum", "0", "--steps", str(args.steps), "--log-every", str(args.log_every), "--eval-every", "1000", "--out", str(out)],
        timeout_s=args.timeout, env={"OMP_NUM_THREADS": "1"},
    )
    (out / "load.json").write_text(json.dumps({"before": load_before, "after": os.getloadavg()[0]}) + "\n")


def steady(log: Path) -> dict[str, float]:
    """Samples/s and busy/comm/idle of one run after its first record (weighted by interval)."""
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    if len(records) < 2:
        raise SystemExit(f"{log}: need at least 2 records (raise --steps or lower --log-every)")
    last_wall = records[0]["wall_s"]
    samples = wall = 0.0
    split = {"busy": 0.0, "comm": 0.0, "idle": 0.0}
    for record in records[1:]:
        interval = record["wall_s"] - last_wall
        last_wall = record["wall_s"]
        samples += record["samples_per_s"] * interval
        wall += interval
        for key in split:
            split[key] += interval * sum(record[key]) / len(record[key])
    return {"samples_per_s": samples / wall, **{k: v / wall for k, v in split.items()}}


def collect(out: Path, cores: int) -> list[dict[str, object]]:
    """scaling.csv's rows from every solver run present (a piece that failed part-way keeps
    the runs it finished)."""
    rows = []
    for summary_path in sorted(out.glob("*-n*/*.summary.json")):
        summary = json.loads(summary_path.read_text())
        load = json.loads((summary_path.parent / "load.json").read_text()) if (summary_path.parent / "load.json").exists() else {}
        workload = summary["workload"]
        log = summary_path.with_name(summary_path.name.replace(".summary.json", ".jsonl"))
        rows.append({"model": workload["model"], "solver": summary["solver"], "ranks": summary["ranks"],
                     "batch": workload["batch_size"], "steps": workload["steps"], **steady(log),
                     "load_before": load.get("before", ""), "load_after": load.get("after", "")})
    single = {(r["model"], r["solver"]): r["samples_per_s"] for r in rows if r["ranks"] == 1}
    for r in rows:
        one = single.get((r["model"], r["solver"]))
        r["iteration_s"] = r["ranks"] * r["batch"] / r["samples_per_s"]  # one rank's time per micro-batch
        r["speedup"] = r["samples_per_s"] / one if one else ""
        r["efficiency"] = r["speedup"] / r["ranks"] if one else ""
        r["cores_efficiency"] = r["speedup"] / min(r["ranks"], cores) if one else ""
    rows.sort(key=lambda r: (r["model"], r["solver"], r["ranks"]))
    return rows


def plot(rows: list[dict[str, object]], out: Path, cores: int) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        solvers = list(dict.fromkeys(r["solver"] for r in mine))
        ranks = sorted({r["ranks"] for r in mine})
        reference = "allreduce" if "allreduce" in solvers else solvers[0]  # whose ideal line is drawn
        fig, (thr, eff, brk) = plt.subplots(1, 3, figsize=(19, 5.5), gridspec_kw={"width_ratios": [1, 1, 1.6]})
        for i, solver in enumerate(solvers):
            points = sorted((r["ranks"], r) for r in mine if r["solver"] == solver)
            style = dict(color=f"C{i % 10}", marker="os^vD<>ph*"[i % 10], ms=5, label=solver)
            thr.plot([p for p, _ in points], [r["samples_per_s"] for _, r in points], "-", **style)
            with_eff = [(p, r["efficiency"]) for p, r in points if r["efficiency"] != ""]
            eff.plot([p for p, _ in with_eff], [e for _, e in with_eff], "-", **style)
            one = next((r["samples_per_s"] for p, r in points if p == 1), None)
            if one is not None and solver == reference:
                thr.plot(ranks, [one * p for p in ranks], "k--", lw=1, label=f"ideal (P x 1 rank, {solver})")
                thr.plot(ranks, [one * min(p, cores) for p in ranks], "k:", lw=1, label=f"{cores} cores' bound")
        thr.set(xscale="log", yscale="log", xlabel="ranks", ylabel="samples/s (global, steady state)", title="throughput")
        eff.axhline(1, color="k", ls="--", lw=1)
        eff.plot(ranks, [min(p, cores) / p for p in ranks], "k:", lw=1, label=f"{cores} cores' bound")
        eff.set(xscale="log", xlabel="ranks", ylabel="throughput / (P x 1-rank throughput)", title="weak-scaling efficiency")
        for ax in (thr, eff):
            ax.set_xticks(ranks, [str(p) for p in ranks])
            ax.minorticks_off()
            ax.grid(True, alpha=0.3)
        thr.legend(fontsize=7)
        width = 0.8 / len(ranks)
        for j, p in enumerate(ranks):
            by_solver = {r["solver"]: r for r in mine if r["ranks"] == p}
            xs = [i + (j - (len(ranks) - 1) / 2) * width for i in range(len(solvers))]
            bottom = [0.0] * len(solvers)
            for key, color in (("busy", "C2"), ("comm", "C0"), ("idle", "C3")):
                values = [by_solver[s][key] if s in by_solver else 0.0 for s in solvers]
                brk.bar(xs, values, width * 0.9, bottom=bottom, color=color, label=key if j == 0 else None)
                bottom = [b + v for b, v in zip(bottom, values)]
            for x in xs:
                brk.text(x, 1.01, str(p), ha="center", fontsize=6)
        brk.set_xticks(range(len(solvers)), solvers, rotation=30, ha="right", fontsize=8)
        brk.set(ylim=(0, 1.08), ylabel="share of each rank's time", title=f"busy / comm / idle at {', '.join(map(str, ranks))} ranks (bar labels)")
        brk.legend(fontsize=8, loc="lower right")
        fig.suptitle(f"{model} on digits, {mine[0]['batch']} samples per rank per step, 1 thread per rank, {cores}-core machine")
        fig.tight_layout()
        png = out / f"scaling_{model}.png"
        fig.savefig(png, dpi=100)
        plt.close(fig)
        written.append(png)
    return written


def table(rows: list[dict[str, object]]) -> str:
    """The README's table: samples/s per rank count, efficiency at 2 and 8, busy/comm/idle at 8."""
    ranks = sorted({r["ranks"] for r in rows})
    head = "| model | solver | " + " | ".join(f"samples/s, {p}" for p in ranks) + " | eff. 2 | eff. 8 | busy / comm / idle at 8 |"
    lines = [head, "| " + " | ".join(["---"] * (head.count("|") - 1)) + " |"]
    for model, solver in dict.fromkeys((r["model"], r["solver"]) for r in rows):
        at = {r["ranks"]: r for r in rows if r["model"] == model and r["solver"] == solver}
        cells = [f"{at[p]['samples_per_s']:.0f}" if p in at else "" for p in ranks]
        cells += [f"{at[p]['efficiency']:.2f}" if p in at and at[p]["efficiency"] != "" else "" for p in (2, 8)]
        cells.append(f"{at[8]['busy']:.2f} / {at[8]['comm']:.2f} / {at[8]['idle']:.2f}" if 8 in at else "")
        lines.append(f"| {model} | {solver} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,cnn", help="models, comma-separated (default %(default)s)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8], help="rank counts (default 1 2 4 8)")
    parser.add_argument("--solvers", default="all", help="solvers for compare (default: every registered one)")
    parser.add_argument("--steps", type=int, default=40, help="updates per solver (default %(default)s)")
    parser.add_argument("--log-every", type=int, default=10, help="updates per record; the first is warm-up (default %(default)s)")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step (default %(default)s)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"output directory (default {OUT})")
    parser.add_argument("--plot-only", action="store_true", help="collect and plot what is there, run nothing")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed per piece")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    if not args.plot_only:
        for model in args.models.split(","):
            for ranks in args.ranks:
                run_piece(model, ranks, args)
    rows = collect(args.out, cores)
    if not rows:
        print(f"no runs under {args.out}", file=sys.stderr)
        return 1
    with (args.out / "scaling.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    (args.out / "table.md").write_text(table(rows))
    print(table(rows))
    for png in plot(rows, args.out, cores):
        print(f"wrote {png}")
    print(f"wrote {args.out / 'scaling.csv'} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
