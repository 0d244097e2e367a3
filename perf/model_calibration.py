"""The performance model's calibration on this machine: communication, and ranks sharing cores.

Write-up, figures and provenance: docs/studies/performance-model.md. None of these runs is
one of the scaling study's (perf/scaling.py), which the model is checked against:

1. ``comm``: ``bench sweep`` (the solvers' bucketed allreduce and Adasum, 4 B to 16 MiB)
   and ``bench windows`` (the shared path, 0.25, 2 and 8 MiB) at 2, 4 and 8 ranks
   -> ``sweep_n<P>.csv``, ``windows_n<P>.csv``: the alpha, beta and window fits
   (``machine.json``: the cores).
2. ``compute``: for each workload of the scaling study (``real``: mlp, cnn; ``emulated``:
   mlp on the study's emulated device, perf/results/scaling/device.json), P = 1, 2, 4, 8
   one-rank trainings at once: P separate MPI jobs, so no rank communicates, trained as
   the study trains (the allreduce solver, 32 samples a step, plain SGD,
   OMP_NUM_THREADS=1). A rank's iteration at P is the mean over the P jobs
   -> ``compute.csv`` (``compute-<K>.csv`` for ``--repeat K`` > 1: series, model, ranks,
   iteration_s, spread, and outside_cores: the cores' worth other processes used
   meanwhile, perf/launch.py's ``OutsideLoad``).
3. ``sync``: the study's harness (perf/scaling.py) on a synthetic workload
   (perf/synthetic_load.py: about ``--loop-ms`` of matrix products a step and 64 Ki or
   1 Mi parameters) with one solver per kind of exchange: ``allreduce`` (a lockstep
   collective), ``async-sgd`` (a locked window), ``hogwild-sgd`` (a wild one), ``abs-sgd``
   (its round's bookkeeping) and ``adasum`` (its delta's passes), at 1, 2, 4 and 8 ranks
   -> ``sync_<numel>/scaling.csv``
   (``sync_<numel>-<K>/`` for ``--repeat K``; ``--sync-solvers`` and ``--ranks`` run some
   of them, replacing their rows and keeping the others'; a table's workload, recorded in
   its ``workload.json``, is kept: delete the directory to measure ``--loop-ms`` anew).

With ``PERF_LOCK`` set (a file), each run or group of runs holds ``flock PERF_LOCK``::

    PERF_LOCK=/tmp/mpisolve-cpu.lock python perf/model_calibration.py   # all three -> perf/results/model_calibration/
    python perf/model_calibration.py --stages compute --ranks 1 4
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from launch import RESULTS, OutsideLoad, machine_lock, mpiexec, run_mpisolve
from scaling import collect, run_piece

OUT = RESULTS / "model_calibration"
#: (series, model, micro-batches, records every): long enough (several seconds alone) that
#: the jobs' staggered starts leave their middle thirds running together.
WORKLOADS = (("real", "mlp", 500, 25), ("real", "cnn", 1000, 50), ("emulated", "mlp", 150, 10))
SYNC_SOLVERS = "allreduce,async-sgd,hogwild-sgd,abs-sgd,adasum"
SYNC_NUMELS = (64 * 1024, 1024 * 1024)
FIELDS = ("series", "model", "ranks", "iteration_s", "spread", "outside_cores")


def concurrent_iterations(
    series: str, model: str, batches: int, log_every: int, ranks: int, out: Path, device_ms: float | None
) -> list[float]:
    """Seconds per micro-batch of each of ``ranks`` one-rank trainings run at once, over the
    middle third of each one's records (the others start and end around it)."""
    logs = [out / f"{series}-{model}-p{ranks}-{i}.jsonl" for i in range(ranks)]
    command = [sys.executable, "-m", "mpi4py", "-m", "mpisolve", "train", "--solver", "allreduce"]
    command += ["--model", model, "--dataset", "digits", "--batch-size", "32", "--momentum", "0"]
    command += ["--steps", str(batches), "--log-every", str(log_every), "--eval-every", "1000"]
    command += ["--device-ms", f"{device_ms:.6g}"] if device_ms is not None else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": "600"}
    jobs = [
        subprocess.Popen(
            [mpiexec(), "-n", "1", *command, "--log", str(log)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log.with_suffix(".err").open("w"),
        )
        for log in logs
    ]
    if any(job.wait(timeout=660) for job in jobs):
        raise SystemExit(f"a {series} {model} training at {ranks} at once failed (see {out}/*.err)")
    return [middle_seconds(log) for log in logs]


def middle_seconds(log: Path) -> float:
    """Seconds per update over the middle third of a one-rank training's records."""
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    third = len(records) // 3
    if third < 1:
        raise SystemExit(f"{log}: {len(records)} records, need 3 or more")
    first, last = records[third - 1], records[len(records) - third - 1]
    return (last["wall_s"] - first["wall_s"]) / (last["step"] - first["step"])


def measure_comm(args: argparse.Namespace) -> None:
    for ranks in [p for p in args.ranks if p > 1]:
        sweep = ["bench", "sweep", "--ops", "bucketed,adasum", "--max-bytes", "16M", "--repeats", "20"]
        run_mpisolve(ranks, [*sweep, "--csv", str(args.out / f"sweep_n{ranks}.csv")], timeout_s=600)
        windows = ["bench", "windows", "--numel", "65536,524288,2097152", "--paths", "shared"]
        windows += ["--no-progress-overhead", "--repeats", "7", "--warmup", "2"]
        run_mpisolve(ranks, [*windows, "--csv", str(args.out / f"windows_n{ranks}.csv")], timeout_s=600)


def measure_compute(args: argparse.Namespace) -> None:
    out = args.out / "compute"
    out.mkdir(parents=True, exist_ok=True)
    device = json.loads((RESULTS / "scaling" / "device.json").read_text())
    rows = []
    for series, model, batches, log_every in WORKLOADS:
        device_ms = float(device[model]["device_ms"]) if series == "emulated" else None
        for ranks in args.ranks:
            with machine_lock(), OutsideLoad() as load:
                seconds = concurrent_iterations(series, model, batches, log_every, ranks, out, device_ms)
            mean = statistics.fmean(seconds)
            rows.append(
                {
                    "series": series,
                    "model": model,
                    "ranks": ranks,
                    "iteration_s": mean,
                    "spread": (max(seconds) - min(seconds)) / mean,
                    "outside_cores": load.cores(),
                }
            )
            print(
                f"{series} {model}: {ranks} at once, {mean * 1e3:.2f} ms a micro-batch "
                f"(other processes: {load.cores():.2f} cores)"
            )
    with (args.out / ("compute.csv" if args.repeat == 1 else f"compute-{args.repeat}.csv")).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def loops_for(ms: float) -> int:
    """Matrix products of the synthetic workload that take ``ms`` on one thread alone."""
    torch.set_num_threads(1)
    work = torch.randn(96, 96)
    for _ in range(200):
        torch.mm(work, work)
    start, count = time.perf_counter(), 5000
    for _ in range(count):
        torch.mm(work, work)
    return max(1, round(ms * 1e-3 * count / (time.perf_counter() - start)))


def measure_sync(args: argparse.Namespace) -> None:
    cores = len(os.sched_getaffinity(0))
    measured_loops = None
    for numel in SYNC_NUMELS:
        out = args.out / (f"sync_{numel}" if args.repeat == 1 else f"sync_{numel}-{args.repeat}")
        recorded = out / "workload.json"  # a table's rows are of one workload: runs added to it reuse it
        if recorded.exists():
            loops = int(json.loads(recorded.read_text())["loops"])
        else:
            loops = measured_loops = measured_loops or loops_for(args.loop_ms)
        os.environ.update(MPISOLVE_SYNTH_NUMEL=str(numel), MPISOLVE_SYNTH_LOOPS=str(loops))
        piece = argparse.Namespace(
            out=out,
            batches=40,
            batch=32,
            solvers=args.sync_solvers,
            log_every=8,
            timeout=600,
            device_for=8,
        )
        piece.out.mkdir(parents=True, exist_ok=True)
        (piece.out / "workload.json").write_text(json.dumps({"numel": numel, "loops": loops}) + "\n")
        for ranks in args.ranks:
            run_piece("perf.synthetic_load:make", ranks, "real", piece, cores)
        ran = set(args.sync_solvers.split(","))
        table = piece.out / "scaling.csv"
        kept = [r for r in csv.DictReader(table.open(newline=""))] if table.exists() else []
        rows = [r for r in collect(piece.out, cores) if r["solver"] in ran and r["ranks"] in args.ranks]
        rerun = {(r["solver"], r["ranks"]) for r in rows}
        rows += [r for r in kept if (r["solver"], int(r["ranks"])) not in rerun]
        rows.sort(key=lambda r: (str(r["solver"]), int(r["ranks"])))
        with table.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {piece.out / 'scaling.csv'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default="comm,compute,sync", help="some of %(default)s (default: all)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8], help="rank counts (default 1 2 4 8)")
    parser.add_argument("--repeat", type=int, default=1, help="the compute and sync stages' repeat number (default 1)")
    parser.add_argument("--sync-solvers", default=SYNC_SOLVERS, help="the sync stage's solvers (default %(default)s)")
    parser.add_argument("--loop-ms", type=float, default=4.0, help="the synthetic workload's ms of products a step")
    parser.add_argument("--out", type=Path, default=OUT, help=f"output directory (default {OUT})")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "machine.json").write_text(json.dumps({"cores": len(os.sched_getaffinity(0))}) + "\n")
    stages = args.stages.split(",")
    if "comm" in stages:
        measure_comm(args)
    if "compute" in stages:
        measure_compute(args)
    if "sync" in stages:
        measure_sync(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
