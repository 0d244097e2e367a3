"""Window exchanges (``bench windows``) at 2, 4 and 8 ranks over vector sizes, as CSV and a table.

Write-up, figures and provenance: docs/studies/performance-model.md.

Runs ``python -m mpi4py -m mpisolve bench windows`` once per rank count on the shared
path (one node: what the window solvers use here), both modes and layouts, at
``--numel`` sizes that bracket the models of the scaling study (the CNN's 52 thousand
parameters, the MLP's 1.1 million). The performance model fits the window exchange's
alpha and beta to these rows (perf/scaling_model.py)::

    python perf/comm_windows.py                  # 2, 4, 8 ranks
    python perf/comm_windows.py --ranks 4        # one rank count; rewrites the table from all CSVs present

Writes ``<out>/windows_n<N>.csv`` and ``<out>/table.md`` (default out: perf/results/comm_windows).
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from launch import RESULTS, run_mpisolve

OUT = RESULTS / "comm_windows"
SIZES = "65536,524288,2097152"


def table(out: Path) -> str:
    rows = []
    for path in sorted(out.glob("windows_n*.csv")):
        with path.open(newline="") as f:
            rows += list(csv.DictReader(f))
    sizes = sorted({int(r["numel"]) for r in rows})
    head = "| ranks | mode | layout | " + " | ".join(f"{n * 4 / 2**20:g} MiB (ms)" for n in sizes) + " |"
    lines = [head, "| " + " | ".join(["---"] * (head.count("|") - 1)) + " |"]
    keys = dict.fromkeys((int(r["ranks"]), r["mode"], r["layout"]) for r in rows)
    for ranks, mode, layout in sorted(keys):
        at = {
            int(r["numel"]): float(r["seconds"])
            for r in rows
            if (int(r["ranks"]), r["mode"], r["layout"]) == (ranks, mode, layout)
        }
        lines.append(
            f"| {ranks} | {mode} | {layout} | "
            + " | ".join(f"{at[n] * 1e3:.2f}" if n in at else "" for n in sizes)
            + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="rank counts (default 2 4 8)")
    parser.add_argument("--numel", default=SIZES, help="vector sizes in elements (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=7, help="timed exchanges per case (default %(default)s)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--timeout", type=float, default=300, help="seconds allowed per rank count")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for ranks in args.ranks:
        run_mpisolve(
            ranks,
            [
                "bench",
                "windows",
                "--numel",
                args.numel,
                "--paths",
                "shared",
                "--no-progress-overhead",
                "--repeats",
                str(args.repeats),
                "--warmup",
                "2",
                "--csv",
                str(args.out / f"windows_n{ranks}.csv"),
            ],
            timeout_s=args.timeout,
        )
    text = table(args.out)
    (args.out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
