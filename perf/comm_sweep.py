"""Allreduce latency and bus bandwidth over message sizes at 2, 4 and 8 ranks, as CSV and PNG.

Write-up, figures and provenance: docs/studies/comm-sweep.md.

Runs ``python -m mpi4py -m mpisolve bench sweep`` once per rank count (one CSV each),
then plots every CSV present in the output directory::

    python perf/comm_sweep.py                      # 2, 4, 8 ranks, then the plot
    python perf/comm_sweep.py --ranks 4            # one rank count; replots all CSVs present
    python perf/comm_sweep.py --plot-only
    python perf/comm_sweep.py --ranks 2 -- --factor 2 --ops mpi,bucketed   # after --: bench sweep options

Writes ``<out>/comm_sweep_n<N>.csv`` (the rows), ``<out>/comm_sweep_n<N>.json`` (the MPI
library and the machine's load average around the run), ``<out>/comm_sweep.png`` and
``<out>/table.md`` (the study's table); default out: perf/results/comm_sweep. Run it
alone on the machine: other work on the same cores shows up in every figure.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path

from launch import RESULTS, run_mpisolve

OUT = RESULTS / "comm_sweep"
CSV_NAME = re.compile(r"comm_sweep_n(\d+)\.csv")
STYLE = {"mpi": "k-o", "sum": "C0-s", "average": "C1-^", "bucketed": "C2-D", "adasum": "C3-v"}


def run_sweep(ranks: int, out: Path, bench_args: list[str], timeout_s: float) -> Path:
    csv_path = out / f"comm_sweep_n{ranks}.csv"
    stdout = run_mpisolve(ranks, ["bench", "sweep", "--csv", str(csv_path), *bench_args], timeout_s=timeout_s)
    result = json.loads(stdout.strip().splitlines()[-1])
    del result["rows"]  # they are in the CSV
    csv_path.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"  {result['mpi_library']}; load average {result['load_average'][0]:.1f} before, "
        f"{result['load_average'][1]:.1f} after (this run's {ranks} ranks included)",
        flush=True,
    )
    return csv_path


def read_rows(out: Path) -> dict[int, list[dict[str, str]]]:
    """Rows of every sweep CSV in ``out``, by rank count."""
    found = {}
    for path in sorted(out.glob("comm_sweep_n*.csv")):
        match = CSV_NAME.fullmatch(path.name)
        if match:
            with path.open(newline="", encoding="utf-8") as f:
                found[int(match.group(1))] = list(csv.DictReader(f))
    return dict(sorted(found.items()))


def plot(by_ranks: dict[int, list[dict[str, str]]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(by_ranks), figsize=(5 * len(by_ranks), 8), squeeze=False, sharex=True)
    for col, (ranks, rows) in enumerate(by_ranks.items()):
        lat_ax, bw_ax = axes[0][col], axes[1][col]
        for op in dict.fromkeys(r["op"] for r in rows):
            mine = [r for r in rows if r["op"] == op]
            sizes = [int(r["bytes"]) for r in mine]
            lat_ax.plot(sizes, [float(r["latency_us"]) for r in mine], STYLE.get(op, "-x"), label=op, ms=4)
            bw_ax.plot(sizes, [float(r["busbw_GBps"]) for r in mine], STYLE.get(op, "-x"), label=op, ms=4)
        lat_ax.set(xscale="log", yscale="log", title=f"{ranks} ranks", ylabel="latency (us, median)")
        bw_ax.set(xscale="log", xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)")
        for ax in (lat_ax, bw_ax):
            ax.set_xscale("log", base=2)
            ax.grid(True, which="major", alpha=0.3)
        lat_ax.legend(fontsize=8)
    fig.suptitle("Allreduce of float32 messages: busbw = bytes/time x 2(n-1)/n (nccl-tests)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def table(by_ranks: dict[int, list[dict[str, str]]]) -> str:
    """The study's table: latency at 4 B and 64 KiB, busbw at 4 MiB and 64 MiB, per rank count and op."""
    lines = [
        "| ranks | op | latency 4 B (us) | latency 64 KiB (us) | busbw 4 MiB (GB/s) | busbw 64 MiB (GB/s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for ranks, rows in by_ranks.items():
        for op in dict.fromkeys(r["op"] for r in rows):
            at = {int(r["bytes"]): r for r in rows if r["op"] == op}
            cells = [f"{float(at[b]['latency_us']):.0f}" if b in at else "" for b in (4, 64 * 1024)]
            cells += [f"{float(at[b]['busbw_GBps']):.2f}" if b in at else "" for b in (4 * 2**20, 64 * 2**20)]
            lines.append(f"| {ranks} | {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    argv = sys.argv[1:]
    bench_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="rank counts to run (default 2 4 8)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"CSV and PNG directory (default {OUT})")
    parser.add_argument("--plot-only", action="store_true", help="plot the CSVs present, run nothing")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed per rank count")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.plot_only:
        for ranks in args.ranks:
            run_sweep(ranks, args.out, bench_args, args.timeout)
    by_ranks = read_rows(args.out)
    if not by_ranks:
        print(f"no comm_sweep_n*.csv in {args.out}", file=sys.stderr)
        return 1
    png = args.out / "comm_sweep.png"
    plot(by_ranks, png)
    (args.out / "table.md").write_text(table(by_ranks))
    print(table(by_ranks))
    print(f"wrote {png} and table.md ({', '.join(map(str, by_ranks))} ranks)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
