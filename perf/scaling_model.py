"""The performance model: calibrated on this machine, checked against the scaling study,
projected to 16-1,024 GPUs.

Write-up, figures and provenance: docs/studies/performance-model.md.

1. Calibration: alpha and beta fitted to the ``bucketed`` rows of the communication
   sweep (perf/results/comm_sweep/*.csv: the solvers' own allreduce path), Adasum's gamma
   to its ``adasum`` rows, once per rank count; the window exchange's alpha and beta, per
   mode (locked, wild), to ``bench windows`` (perf/results/comm_windows/*.csv, shared
   path, sharded layout), once per rank count.
2. Validation: for each series, model and solver of the scaling study
   (perf/results/scaling/scaling.csv), the model is given the measured 1-rank iteration
   time of the same series (compute) and, for the ``real`` series, the machine's core
   count (P ranks on C cores compute P/C times slower; an ``emulated`` rank has a device
   of its own), and predicts the 2-8 rank iteration, each solver on its own schedule
   (tau) and exchange (window solvers priced by the window fit; ``error_allreduce_priced``
   keeps what pricing them with the allreduce fit gave). The relative errors go to
   validation.csv, validation.md (the study's tables: per run, and per solver) and
   validation.png.
3. Projection: ``python -m mpisolve model`` for ResNet-18 and ResNet-50 on 100 Gb/s
   InfiniBand with H100-class compute, 16 to 1,024 GPUs: projection_<model>.csv, the
   command's printed table (projection_<model>.txt) and projection.png.

Everything goes to perf/results/scaling_model/ (``--out``)::

    python perf/scaling_model.py
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
from pathlib import Path

from launch import RESULTS

from mpisolve.perfmodel.calibrate import (
    fit_adasum_gamma,
    fit_network,
    fit_window,
    read_sweep,
    read_window_bench,
    relative_errors,
)
from mpisolve.perfmodel.iteration import MODELS, Case, Compute, iteration, model_options
from mpisolve.perfmodel.network import Network, window_exchange
from mpisolve.perfmodel.workloads import workload

OUT = RESULTS / "scaling_model"
PROJECTED = ("allreduce", "adasum", "easgd", "local-sgd", "async-sgd", "ea-wild", "kfac")
PROJECTION_RANKS = "16,32,64,128,256,512,1024"


def calibrate(sweep_dir: Path) -> dict[int, tuple[Network, float, float]]:
    """Per rank count: the fitted network, Adasum's gamma, the fit's median |relative error|.

    One fit per rank count: on an oversubscribed machine alpha and beta change with the
    number of ranks sharing the cores, which one alpha-beta law over all counts cannot follow.
    """
    rows = read_sweep(sorted(sweep_dir.glob("comm_sweep_n*.csv")))
    fits = {}
    for p in sorted({int(r["ranks"]) for r in rows}):
        mine = [r for r in rows if int(r["ranks"]) == p]
        net = fit_network(mine, op="bucketed", algorithm="halving-doubling", name=f"this machine, {p} ranks")
        errors = [abs(e) for e in relative_errors(mine, net, op="bucketed")]
        fits[p] = (net, fit_adasum_gamma(mine, net), statistics.median(errors))
        print(
            f"calibration at {p} ranks: alpha {net.alpha * 1e6:.1f} us, beta {net.beta * 1e9:.3f} ns/B, gamma_adasum "
            f"{fits[p][1] * 1e9:.3f} ns/B; |error| over the bucketed rows: median {fits[p][2]:.0%}, "
            f"max {max(errors):.0%}"
        )
    return fits


def calibrate_windows(windows_dir: Path) -> dict[int, dict[str, Network]]:
    """Per rank count: the window exchange's fitted network per mode ("locked", "wild")."""
    rows = read_window_bench(sorted(windows_dir.glob("windows_n*.csv")))
    fits = {}
    for p in sorted({int(r["ranks"]) for r in rows}):
        mine = [r for r in rows if int(r["ranks"]) == p]
        fits[p] = fit_window(mine)
        for mode, net in fits[p].items():
            errors = [
                abs(window_exchange(net, p, float(r["bytes"]), locked=mode == "locked") - float(r["seconds"]))
                / float(r["seconds"])
                for r in mine
                if r["mode"] == mode and r["layout"] == "sharded" and r["path"] == "shared"
            ]
            print(
                f"window calibration at {p} ranks, {mode}: alpha {net.alpha * 1e6:.1f} us, "
                f"beta {net.beta * 1e9:.3f} ns/B; "
                f"|error| over its rows: max {max(errors):.0%}"
            )
    return fits


def validate(
    fits: dict[int, tuple[Network, float, float]],
    window_fits: dict[int, dict[str, Network]],
    scaling_csv: Path,
    cores: int,
) -> list[dict[str, object]]:
    with scaling_csv.open(newline="") as f:
        measured = list(csv.DictReader(f))
    single = {(r["series"], r["model"], r["solver"]): float(r["iteration_s"]) for r in measured if int(r["ranks"]) == 1}
    loads = {}
    out = []
    for r in measured:
        p, key = int(r["ranks"]), (r["series"], r["model"], r["solver"])
        if p not in fits or key not in single or r["solver"] not in MODELS:
            continue
        net, gamma_adasum, _ = fits[p]
        load = loads.setdefault(r["model"], workload(r["model"]))
        compute = Compute(step_s=single[key], batch=int(r["batch"]), cores=cores if r["series"] == "real" else None)
        options = model_options(r["solver"], {})
        it = iteration(r["solver"], Case(load, net, compute, p, 4, gamma_adasum, window_fits.get(p)), options)
        plain = iteration(
            r["solver"], Case(load, net, compute, p, 4, gamma_adasum), options
        )  # windows priced as allreduce
        seen = float(r["iteration_s"])
        out.append(
            {
                "series": r["series"],
                "model": r["model"],
                "solver": r["solver"],
                "ranks": p,
                "measured_ms": seen * 1e3,
                "predicted_ms": it.total * 1e3,
                "compute_ms": it.compute * 1e3,
                "comm_ms": it.comm * 1e3,
                "error": (it.total - seen) / seen,
                "error_allreduce_priced": (plain.total - seen) / seen,
            }
        )
    return out


def validation_tables(validation: list[dict[str, object]]) -> list[str]:
    """The study's validation tables: every run, then the error per solver."""
    lines = [
        "| series | model | solver | measured 2 / 4 / 8 ranks (ms) | model (ms) | error 2 | error 4 | error 8 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for series, model, solver in dict.fromkeys((r["series"], r["model"], r["solver"]) for r in validation):
        at = {r["ranks"]: r for r in validation if (r["series"], r["model"], r["solver"]) == (series, model, solver)}
        measured = " / ".join(f"{at[p]['measured_ms']:.1f}" if p in at else "-" for p in (2, 4, 8))
        predicted = " / ".join(f"{at[p]['predicted_ms']:.1f}" if p in at else "-" for p in (2, 4, 8))
        errors = " | ".join(f"{at[p]['error']:+.0%}" if p in at else "" for p in (2, 4, 8))
        lines.append(f"| {series} | {model} | {solver} | {measured} | {predicted} | {errors} |")
    abs_errors = [abs(float(r["error"])) for r in validation]
    lines.append(
        f"\n|error| over {len(abs_errors)} runs: median {statistics.median(abs_errors):.0%}, "
        f"max {max(abs_errors):.0%}.\n"
    )
    lines += [
        "| solver | runs | median abs. error, real | median abs. error, emulated | median abs. error, all | "
        "all, window solvers priced as allreduce |",
        "| --- | --- | --- | --- | --- | --- |",
    ]

    def median(rows: list[dict[str, object]], key: str = "error") -> str:
        return f"{statistics.median(abs(float(r[key])) for r in rows):.0%}" if rows else "-"

    for solver in sorted({r["solver"] for r in validation}):
        mine = [r for r in validation if r["solver"] == solver]
        lines.append(
            f"| {solver} | {len(mine)} | {median([r for r in mine if r['series'] == 'real'])} | "
            f"{median([r for r in mine if r['series'] == 'emulated'])} | {median(mine)} | "
            f"{median(mine, 'error_allreduce_priced')} |"
        )
    return lines


def project(out: Path) -> dict[str, Path]:
    written = {}
    for model in ("resnet18", "resnet50"):
        path = out / f"projection_{model}.csv"
        command = [
            sys.executable,
            "-m",
            "mpisolve",
            "model",
            "--solver",
            ",".join(PROJECTED),
            "--model",
            model,
            "--ranks",
            PROJECTION_RANKS,
            "--csv",
            str(path),
        ]
        print("+", " ".join(command[1:]), flush=True)
        printed = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
        print(printed, end="")
        (out / f"projection_{model}.txt").write_text("$ python -m mpisolve " + " ".join(command[3:-2]) + "\n" + printed)
        written[model] = path
    return written


def projection_table(projections: dict[str, Path]) -> str:
    """The study's table: efficiency at 16, 128 and 1,024 GPUs and the iteration at 1,024, per model and solver."""
    lines = [
        "| model | solver | efficiency 16 / 128 / 1,024 GPUs | iteration at 1,024 (ms): compute + exposed comm |",
        "| --- | --- | --- | --- |",
    ]
    for model, path in projections.items():
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        for solver in dict.fromkeys(r["solver"] for r in rows):
            at = {int(r["ranks"]): r for r in rows if r["solver"] == solver}
            effs = " / ".join(f"{float(at[p]['efficiency']):.2f}" for p in (16, 128, 1024) if p in at)
            last = at[max(at)]
            lines.append(
                f"| {model} | {solver} | {effs} | {float(last['iteration_ms']):.1f} = "
                f"{float(last['compute_ms']):.1f} + {float(last['exposed_ms']):.1f} |"
            )
    return "\n".join(lines) + "\n"


def plot(validation: list[dict[str, object]], projections: dict[str, Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    solvers = sorted({r["solver"] for r in validation})
    colors = plt.get_cmap("tab20")
    for i, solver in enumerate(solvers):
        labelled = False
        for model, marker in (("mlp", "o"), ("cnn", "s")):
            for series in ("real", "emulated"):
                mine = [
                    r for r in validation if r["solver"] == solver and r["model"] == model and r["series"] == series
                ]
                if not mine:
                    continue
                color = colors(i % 20)
                ax.scatter(
                    [r["measured_ms"] for r in mine],
                    [r["predicted_ms"] for r in mine],
                    marker=marker,
                    s=25,
                    color=color if series == "real" else "none",
                    edgecolors=color,
                    label=None if labelled else solver,
                )
                labelled = True
    values = [v for r in validation for v in (r["measured_ms"], r["predicted_ms"])]
    lo, hi = min(values) / 1.5, max(values) * 1.5
    ax.plot([lo, hi], [lo, hi], "k--", lw=1)
    ax.plot([lo, hi], [2 * lo, 2 * hi], "k:", lw=0.8)
    ax.plot([lo, hi], [lo / 2, hi / 2], "k:", lw=0.8)
    ax.set(
        xscale="log",
        yscale="log",
        xlim=(lo, hi),
        ylim=(lo, hi),
        xlabel="measured iteration (ms)",
        ylabel="model (ms)",
        title="model vs measured, 2-8 ranks\n(o mlp, s cnn; filled real, hollow emulated; dotted: 2x)",
    )
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "validation.png", dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(projections), figsize=(6 * len(projections), 4.8), squeeze=False)
    for ax, (model, path) in zip(axes[0], projections.items()):
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        for i, solver in enumerate(dict.fromkeys(r["solver"] for r in rows)):
            mine = [r for r in rows if r["solver"] == solver]
            ax.plot(
                [int(r["ranks"]) for r in mine],
                [float(r["efficiency"]) for r in mine],
                "-o",
                ms=4,
                color=f"C{i}",
                label=solver,
            )
        ax.set(
            xscale="log",
            ylim=(0, 1.05),
            xlabel="GPUs",
            ylabel="weak-scaling efficiency",
            title=f"{model}: 100 Gb/s InfiniBand, H100-class GPUs",
        )
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "projection.png", dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", type=Path, default=RESULTS / "comm_sweep", help="directory of comm_sweep_n*.csv")
    parser.add_argument("--windows", type=Path, default=RESULTS / "comm_windows", help="directory of windows_n*.csv")
    parser.add_argument(
        "--scaling", type=Path, default=RESULTS / "scaling" / "scaling.csv", help="the scaling study's CSV"
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    fits = calibrate(args.sweep)
    window_fits = calibrate_windows(args.windows)
    validation = validate(fits, window_fits, args.scaling, cores)
    with (args.out / "validation.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(validation[0]))
        writer.writeheader()
        writer.writerows(validation)
    with (args.out / "calibration.csv").open("w", newline="") as f:
        csv.writer(f).writerows(
            [
                (
                    "ranks",
                    "exchange",
                    "alpha_s",
                    "beta_s_per_byte",
                    "gamma_adasum_s_per_byte",
                    "median_abs_error",
                    "cores",
                )
            ]
            + [(p, "allreduce", net.alpha, net.beta, gamma, error, cores) for p, (net, gamma, error) in fits.items()]
            + [
                (p, f"window {mode}", net.alpha, net.beta, "", "", cores)
                for p, nets in window_fits.items()
                for mode, net in nets.items()
            ]
        )
    lines = validation_tables(validation)
    lines += [
        "",
        "| ranks | alpha (us) | beta (ns/B) | Adasum gamma (ns/B) | fit's median abs. error over the sweep | "
        "window locked: alpha (us), beta (ns/B) | window wild: alpha (us), beta (ns/B) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {p} | {net.alpha * 1e6:.1f} | {net.beta * 1e9:.3f} | {gamma * 1e9:.3f} | {error:.0%} | "
        + " | ".join(
            f"{w[m].alpha * 1e6:.1f}, {w[m].beta * 1e9:.3f}" if (w := window_fits.get(p)) else "-"
            for m in ("locked", "wild")
        )
        + " |"
        for p, (net, gamma, error) in fits.items()
    ]
    (args.out / "validation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    projections = project(args.out)
    (args.out / "projection.md").write_text(projection_table(projections))
    print(projection_table(projections))
    plot(validation, projections, args.out)
    print(f"wrote {args.out}/: calibration.csv, validation.csv/.md/.png, projection_*.csv/.txt, projection.md/.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
