"""Weak scaling of every solver at 1, 2, 4 and 8 ranks: throughput, efficiency, busy/comm/idle.

Write-up, figures and provenance: docs/studies/scaling.md.

Two series, each labelled in every output:

- ``real``: the ranks compute for real, one torch thread each (OMP_NUM_THREADS=1, so a
  rank is one core's worth of compute). With more ranks than cores they take turns, so
  beyond the core count this measures contention as much as the solver.
- ``emulated``: every rank has an emulated device (the trainer's ``--device-ms``): a
  micro-batch takes exactly ``batch x MS`` ms, its real compute included, then a sleep.
  MS is the same at every rank count, so the compute per step does not change with the
  number of ranks and the scaling left is communication and synchronisation. MS (per
  model, ``device.json``) is the 1-rank ``--device-ms auto`` figure (2 x the solo compute
  per sample) times the ranks sharing each core at 8 ranks (``--device-for``), so that the
  contended real compute still fits in it (the summaries' ``device_overruns`` check it).

For each model, rank count and series, ``mpisolve compare`` trains every solver in turn
at a fixed per-rank batch, plain SGD (momentum 0: the ``m`` solvers bring their own),
until every rank has computed about ``--batches`` micro-batches: the run is given in
epochs (batches x batch x ranks global samples), which mean the same for every solver,
where an update does not (local-sgd's spans ``tau`` micro-batches, an asynchronous
solver's one rank's). Records come every ``--log-every`` updates; asynchronous solvers
(``Solver.lockstep`` False) count every rank's updates, so they run in a second
``compare`` with ``--log-every`` times the rank count. From each solver's metrics log
the first record (warm-up) is dropped; the rest give the
steady-state samples/s (every rank's trained samples over its own time, summed) and the
busy/comm/idle split (mpisolve.train.accounting), averaged over ranks. Writes, under
``--out`` (default perf/results/scaling)::

    <model>-n<P>/, <model>-dev-n<P>/   the compare runs' logs and summaries (real, emulated)
    device.json                         the emulated device's ms per sample, per model
    scaling.csv                         one row per series, model, solver, ranks
    table.md                            the study's tables
    scaling_<model>[_emulated].png      throughput with the ideal line, efficiency, stacked breakdown

Efficiency is weak scaling's, throughput(P) / (P x throughput(1)) within a series;
``bound_efficiency`` divides by the most the series could give instead: min(P, cores)
x throughput(1) for ``real``, P x throughput(1) (a device per rank) for ``emulated``.
::

    python perf/scaling.py                                  # everything, then the plots
    python perf/scaling.py --models mlp --ranks 8 --series real   # one piece; replots what is there
    python perf/scaling.py --plot-only
    python perf/scaling.py --solvers allreduce,adasum       # default: every registered solver
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from pathlib import Path

from launch import RESULTS, OutsideLoad, run_mpisolve

from mpisolve.solvers import solver_names as registered
from mpisolve.solvers.base import solver_class
from mpisolve.train.data import load_dataset

OUT = RESULTS / "scaling"
SERIES = ("real", "emulated")
FIELDS = (
    "series",
    "model",
    "solver",
    "ranks",
    "batch",
    "epochs",
    "steps",
    "device_ms",
    "iteration_s",
    "samples_per_s",
    "speedup",
    "efficiency",
    "bound_efficiency",
    "busy",
    "comm",
    "idle",
    "device_overruns",
    "load_before",
    "load_after",
    "outside_cores",
)


def piece_dir(out: Path, model: str, ranks: int, series: str) -> Path:
    return out / (f"{model}-n{ranks}" if series == "real" else f"{model}-dev-n{ranks}")


def device_ms(model: str, args: argparse.Namespace, cores: int) -> float:
    """The emulated device's ms per sample for ``model`` (measured once, kept in device.json)."""
    path = args.out / "device.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    if model not in known:
        printed = run_mpisolve(
            1,
            [
                "train",
                "--solver",
                "allreduce",
                "--model",
                model,
                "--dataset",
                "digits",
                "--batch-size",
                str(args.batch),
                "--steps",
                "2",
                "--eval-every",
                "1000",
                "--device-ms",
                "auto",
            ],
            timeout_s=args.timeout,
            env={"OMP_NUM_THREADS": "1"},
        )
        solo = json.loads(printed.strip().splitlines()[-1])["device_ms_per_sample"]  # 2 x solo compute per sample
        sharing = math.ceil(args.device_for / cores)
        known[model] = {"device_ms": solo * sharing, "auto_at_1_rank": solo, "ranks_per_core": sharing}
        path.write_text(json.dumps(known, indent=1) + "\n")
    return float(known[model]["device_ms"])


def run_piece(model: str, ranks: int, series: str, args: argparse.Namespace, cores: int) -> None:
    """Every solver at ``ranks``: lockstep ones in one compare, asynchronous ones (more
    updates: each rank's counts) in another, into the same directory."""
    out = piece_dir(args.out, model, ranks, series)
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    recorded = out / "load.json"  # the other processes' load during the runs already here is kept
    outside: dict[str, float] = json.loads(recorded.read_text()).get("outside_cores", {}) if recorded.exists() else {}
    recorded.write_text(json.dumps({"before": load_before, "outside_cores": outside}) + "\n")
    names = registered() if args.solvers == "all" else args.solvers.split(",")
    device = ["--device-ms", f"{device_ms(model, args, cores):.6g}"] if series == "emulated" else []
    epochs = args.batches * args.batch * ranks / len(load_dataset("digits").train)
    for lockstep in (True, False):
        group = [n for n in names if solver_class(n).lockstep == lockstep]
        if not group:
            continue
        per_rank = 1 if lockstep else ranks  # an asynchronous solver's updates are every rank's
        load = OutsideLoad()
        run_mpisolve(
            ranks,
            [
                "compare",
                "--solvers",
                ",".join(group),
                "--model",
                model,
                "--dataset",
                "digits",
                "--batch-size",
                str(args.batch),
                "--momentum",
                "0",
                "--epochs",
                f"{epochs:.6g}",
                "--log-every",
                str(args.log_every * per_rank),
                "--eval-every",
                "1000",
                "--out",
                str(out),
                *device,
            ],
            timeout_s=args.timeout,
            env={"OMP_NUM_THREADS": "1"},
            load=load,
        )
        for name in group:  # each solver's run: its summary's time, back by its training's wall time
            summary = out / f"{name}.summary.json"
            end = summary.stat().st_mtime
            outside[name] = load.cores(end - json.loads(summary.read_text())["wall_s"], end)
    loads = {"before": load_before, "after": os.getloadavg()[0], "outside_cores": outside}
    recorded.write_text(json.dumps(loads) + "\n")


def steady(log: Path) -> dict[str, float]:
    """Samples/s and busy/comm/idle of one run after its first record (weighted by interval)."""
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    if len(records) < 2:
        raise SystemExit(f"{log}: need at least 2 records (raise --batches or lower --log-every)")
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
        load = (
            json.loads((summary_path.parent / "load.json").read_text())
            if (summary_path.parent / "load.json").exists()
            else {}
        )
        workload = summary["workload"]
        log = summary_path.with_name(summary_path.name.replace(".summary.json", ".jsonl"))
        overruns = summary.get("device_overruns") or []
        rows.append(
            {
                "series": "emulated" if workload.get("device_ms") else "real",
                "model": workload["model"],
                "solver": summary["solver"],
                "ranks": summary["ranks"],
                "batch": workload["batch_size"],
                "epochs": workload["epochs"],
                "steps": summary["steps"],
                "device_ms": workload.get("device_ms") or "",
                **steady(log),
                "device_overruns": sum(overruns) / len(overruns) if overruns and workload.get("device_ms") else "",
                "load_before": load.get("before", ""),
                "load_after": load.get("after", ""),
                "outside_cores": load.get("outside_cores", {}).get(summary["solver"], ""),
            }
        )
    single = {(r["series"], r["model"], r["solver"]): r["samples_per_s"] for r in rows if r["ranks"] == 1}
    for r in rows:
        one = single.get((r["series"], r["model"], r["solver"]))
        bound = r["ranks"] if r["series"] == "emulated" else min(r["ranks"], cores)
        r["iteration_s"] = r["ranks"] * r["batch"] / r["samples_per_s"]  # one rank's time per micro-batch
        r["speedup"] = r["samples_per_s"] / one if one else ""
        r["efficiency"] = r["speedup"] / r["ranks"] if one else ""
        r["bound_efficiency"] = r["speedup"] / bound if one else ""
    rows.sort(key=lambda r: (SERIES.index(r["series"]), r["model"], r["solver"], r["ranks"]))
    return rows


def plot(rows: list[dict[str, object]], out: Path, cores: int) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for series, model in sorted({(r["series"], r["model"]) for r in rows}):
        mine = [r for r in rows if r["model"] == model and r["series"] == series]
        emulated = series == "emulated"
        solvers = list(dict.fromkeys(r["solver"] for r in mine))
        ranks = sorted({r["ranks"] for r in mine})
        reference = "allreduce" if "allreduce" in solvers else solvers[0]  # whose ideal line is drawn
        fig, (thr, eff, brk) = plt.subplots(1, 3, figsize=(19, 5.5), gridspec_kw={"width_ratios": [1, 1, 1.6]})
        for i, solver in enumerate(solvers):
            points = sorted((r["ranks"], r) for r in mine if r["solver"] == solver)
            style = dict(color=plt.get_cmap("tab20")(i % 20), marker="os^vD<>ph*"[i % 10], ms=5, label=solver)
            thr.plot([p for p, _ in points], [r["samples_per_s"] for _, r in points], "-", **style)
            with_eff = [(p, r["efficiency"]) for p, r in points if r["efficiency"] != ""]
            eff.plot([p for p, _ in with_eff], [e for _, e in with_eff], "-", **style)
            one = next((r["samples_per_s"] for p, r in points if p == 1), None)
            if one is not None and solver == reference:
                thr.plot(ranks, [one * p for p in ranks], "k--", lw=1, label=f"ideal (P x 1 rank, {solver})")
                if not emulated:
                    thr.plot(ranks, [one * min(p, cores) for p in ranks], "k:", lw=1, label=f"{cores} cores' bound")
        thr.set(
            xscale="log", yscale="log", xlabel="ranks", ylabel="samples/s (global, steady state)", title="throughput"
        )
        eff.axhline(1, color="k", ls="--", lw=1)
        if not emulated:
            eff.plot(ranks, [min(p, cores) / p for p in ranks], "k:", lw=1, label=f"{cores} cores' bound")
        eff.set(
            xscale="log", xlabel="ranks", ylabel="throughput / (P x 1-rank throughput)", title="weak-scaling efficiency"
        )
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
        brk.set(
            ylim=(0, 1.08),
            ylabel="share of each rank's time",
            title=f"busy / comm / idle at {', '.join(map(str, ranks))} ranks (bar labels)",
        )
        brk.legend(fontsize=8, loc="lower right")
        how = (
            f"emulated device per rank ({float(mine[0]['device_ms']):.3g} ms per sample): "
            "communication and synchronisation"
            if emulated
            else "real compute, 1 thread per rank: beyond 2 ranks, core contention"
        )
        fig.suptitle(f"{model} on digits, {mine[0]['batch']} samples per rank per step, {cores}-core machine; {how}")
        fig.tight_layout()
        png = out / (f"scaling_{model}_emulated.png" if emulated else f"scaling_{model}.png")
        fig.savefig(png, dpi=100)
        plt.close(fig)
        written.append(png)
    return written


def table(rows: list[dict[str, object]]) -> str:
    """The study's tables, one per series: samples/s per rank count, efficiency, busy/comm/idle at 8."""
    ranks = sorted({r["ranks"] for r in rows})
    effs = [p for p in ranks if p > 1]
    parts = []
    for series in [s for s in SERIES if any(r["series"] == s for r in rows)]:
        mine = [r for r in rows if r["series"] == series]
        head = (
            "| model | solver | "
            + " | ".join(f"samples/s, {p}" for p in ranks)
            + " | "
            + " | ".join(f"eff. {p}" for p in effs)
            + " | busy / comm / idle at 8 |"
        )
        lines = [
            f"**{series}**"
            + (
                " (emulated device per rank, `--device-ms`)"
                if series == "emulated"
                else " (real compute, ranks share the cores)"
            ),
            "",
            head,
            "| " + " | ".join(["---"] * (head.count("|") - 1)) + " |",
        ]
        for model, solver in dict.fromkeys((r["model"], r["solver"]) for r in mine):
            at = {r["ranks"]: r for r in mine if r["model"] == model and r["solver"] == solver}
            cells = [f"{at[p]['samples_per_s']:.0f}" if p in at else "" for p in ranks]
            cells += [f"{at[p]['efficiency']:.2f}" if p in at and at[p]["efficiency"] != "" else "" for p in effs]
            cells.append(f"{at[8]['busy']:.2f} / {at[8]['comm']:.2f} / {at[8]['idle']:.2f}" if 8 in at else "")
            lines.append(f"| {model} | {solver} | " + " | ".join(cells) + " |")
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,cnn", help="models, comma-separated (default %(default)s)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8], help="rank counts (default 1 2 4 8)")
    parser.add_argument("--series", default=",".join(SERIES), help="real, emulated or both (default %(default)s)")
    parser.add_argument(
        "--device-for",
        type=int,
        default=8,
        metavar="P",
        help="size the emulated device for P ranks sharing the cores (default %(default)s)",
    )
    parser.add_argument("--solvers", default="all", help="solvers for compare (default: every registered one)")
    parser.add_argument(
        "--batches", type=int, default=40, help="micro-batches of each rank per solver (default %(default)s)"
    )
    parser.add_argument(
        "--log-every",
        type=int,
        default=8,
        help="updates of each rank per record; the first is warm-up (default %(default)s)",
    )
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step (default %(default)s)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"output directory (default {OUT})")
    parser.add_argument("--plot-only", action="store_true", help="collect and plot what is there, run nothing")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed per piece")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    series = args.series.split(",")
    unknown = [s for s in series if s not in SERIES]
    if unknown:
        parser.error(f"--series: unknown {', '.join(unknown)} (known: {', '.join(SERIES)})")
    if not args.plot_only:
        for model in args.models.split(","):
            for name in series:
                for ranks in args.ranks:
                    run_piece(model, ranks, name, args, cores)
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
