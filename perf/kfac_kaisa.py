"""mpisolve's K-FAC against KAISA (kfac-pytorch), one configuration per call; the table.

``worker``: one configuration, run under ``mpiexec`` (rank and size from MPI): the same
CIFAR ResNet-18 (``mpisolve.train.models``), the same random batch per rank, SGD with
momentum, cross-entropy; KAISA (``kfac.KFACPreconditioner`` on a DDP model over
torch.distributed gloo) or mpisolve's ``kfac`` solver. ``--kind`` picks the iterations
timed: ``inverse`` (factors and inverses every step), ``factor`` (factors every step,
inverses only at step 0), ``plain`` (neither, after step 0). It prints one JSON line: the
median over ``--iters`` timed iterations (after ``--warmup``) of the slowest rank's
iteration and of each part (forward, backward, the preconditioner or solver step, the
optimizer step; mpisolve's solver breakdown too).

``table``: reads the JSON lines of a results folder and writes ``table.md``: per
implementation and method, every-step iterations (``inverse``) and the typical schedule
(factors every 10 steps, inverses every 100), weighted from the kinds:
``0.01 inverse + 0.09 factor + 0.90 plain``.

``cpu``: until stopped, every 10 s, one line: the cores the benchmark's workers used and
the cores everything else used (from /proc), and the two busiest other processes. The
exclusive lock keeps other engineers' tests out, not builds or jobs that do not take it:
these lines show whether anything ran beside a configuration.

See perf/kfac_kaisa.sh and docs/studies/kfac-kaisa.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

KINDS = {"inverse": (1, 1), "factor": (1, 1_000_000), "plain": (1_000_000, 1_000_000)}
TYPICAL_WEIGHTS = {"inverse": 0.01, "factor": 0.09, "plain": 0.90}


def worker(args: argparse.Namespace) -> None:
    import torch
    from mpi4py import MPI
    from torch import nn

    from mpisolve.train.models import build_model

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    local = world.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local))  # as mpisolve.init does
    factor_steps, inv_steps = KINDS[args.kind]
    torch.manual_seed(0)
    model = build_model("resnet18", (3, 32, 32), 10)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 3, 32, 32, generator=generator)
    y = torch.randint(0, 10, (args.batch,), generator=generator)
    loss_fn = nn.CrossEntropyLoss()
    parts: dict[str, list[float]] = {}

    if args.impl == "kaisa":
        import torch.distributed as dist
        from kfac.preconditioner import KFACPreconditioner

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(args.port))
        dist.init_process_group("gloo", rank=rank, world_size=size)
        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        preconditioner = KFACPreconditioner(
            ddp,
            factor_update_steps=factor_steps,
            inv_update_steps=inv_steps,
            damping=0.001,
            factor_decay=0.95,
            kl_clip=0.001,
            lr=0.1,
            compute_method=args.method,
        )

        def iteration() -> dict[str, float]:
            t0 = time.perf_counter()
            optimizer.zero_grad()
            loss = loss_fn(ddp(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            preconditioner.step()
            t3 = time.perf_counter()
            optimizer.step()
            t4 = time.perf_counter()
            return {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, "optimizer": t4 - t3}

        close = dist.destroy_process_group
    else:
        import mpisolve
        from mpisolve.comm import init

        comm = init()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        solver = mpisolve.make_solver(
            "kfac",
            model,
            optimizer,
            comm=comm.comm,
            variant=args.variant,
            method=args.method,
            factor_update_steps=factor_steps,
            inv_update_steps=inv_steps,
            damping=0.001,
            factor_decay=0.95,
            kl_clip=0.001,
            grad_worker_fraction=args.grad_worker_fraction,
            fusion_profile_steps=2,
        )

        def iteration() -> dict[str, float]:
            solver.reset_timings()
            t0 = time.perf_counter()
            solver.zero_grad()
            loss = loss_fn(model(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            solver.step()
            t3 = time.perf_counter()
            return {"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2, **solver.timings}

        close = solver.close
    for i in range(args.warmup + args.iters):
        world.Barrier()
        start = time.perf_counter()
        timed = iteration()
        timed["iteration"] = time.perf_counter() - start
        slowest = {k: world.allreduce(v, op=MPI.MAX) for k, v in sorted(timed.items())}
        if i >= args.warmup:
            for k, v in slowest.items():
                parts.setdefault(k, []).append(v)
    close()
    if rank == 0:
        result = {
            "impl": args.impl,
            "variant": args.variant if args.impl == "mpisolve" else "kaisa-comm-opt",
            "grad_worker_fraction": args.grad_worker_fraction if args.impl == "mpisolve" else 1.0,
            "method": args.method,
            "kind": args.kind,
            "ranks": size,
            "batch_per_rank": args.batch,
            "warmup": args.warmup,
            "iters": args.iters,
            "median_s": {k: statistics.median(v) for k, v in parts.items()},
            "iteration_s": parts["iteration"],
            "torch": torch.__version__,
        }
        print(json.dumps(result), flush=True)


def table(args: argparse.Namespace) -> None:
    rows = [json.loads(line) for path in sorted(Path(args.results).glob("*.json")) for line in path.open()]
    by_key = {(r["impl"], r["variant"], r["grad_worker_fraction"], r["method"], r["kind"]): r for r in rows}
    setups = sorted({k[:4] for k in by_key})
    lines = [
        "| implementation | method | every step: iteration s | forward | backward | step "
        "| typical 10/100: iteration s | "
        "plain | factor | inverse |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    kaisa = {}
    for setup in setups:
        got = {kind: by_key.get((*setup, kind)) for kind in KINDS}
        every = got["inverse"]
        typical = None
        if all(got.values()):
            typical = sum(TYPICAL_WEIGHTS[k] * got[k]["median_s"]["iteration"] for k in KINDS)
        name = setup[0] if setup[0] == "kaisa" else f"mpisolve {setup[1]} (fraction {setup[2]:g})"
        if setup[0] == "kaisa":
            kaisa[setup[3]] = (every["median_s"]["iteration"] if every else None, typical)

        def cell(entry, part="iteration"):  # noqa: ANN001, ANN202
            return f"{entry['median_s'][part]:.2f}" if entry else "-"

        lines.append(
            f"| {name} | {setup[3]} | {cell(every)} | {cell(every, 'forward')} | {cell(every, 'backward')} | "
            f"{cell(every, 'step')} | {'-' if typical is None else f'{typical:.2f}'} | {cell(got['plain'])} | "
            f"{cell(got['factor'])} | {cell(got['inverse'])} |"
        )
    ratios = ["", "| implementation | method | every step / KAISA | typical / KAISA |", "| --- | --- | --- | --- |"]
    for setup in setups:
        if setup[0] == "kaisa" or setup[3] not in kaisa:
            continue
        got = {kind: by_key.get((*setup, kind)) for kind in KINDS}
        base_every, base_typical = kaisa[setup[3]]
        every = got["inverse"]["median_s"]["iteration"] / base_every if got["inverse"] and base_every else None
        typical = None
        if all(got.values()) and base_typical:
            typical = sum(TYPICAL_WEIGHTS[k] * got[k]["median_s"]["iteration"] for k in KINDS) / base_typical
        ratios.append(
            f"| mpisolve {setup[1]} (fraction {setup[2]:g}) | {setup[3]} | "
            f"{'-' if every is None else f'{every:.2f}'} | {'-' if typical is None else f'{typical:.2f}'} |"
        )
    breakdown = ["", "mpisolve solver breakdown, every step (seconds per iteration, largest over ranks):", ""]
    from mpisolve.solvers.kfac.solver import PHASES as phases  # the solver's own breakdown, in its order

    breakdown += ["| setup | method | " + " | ".join(phases) + " |", "|" + " --- |" * (len(phases) + 2)]
    for setup in setups:
        entry = by_key.get((*setup, "inverse"))
        if setup[0] != "mpisolve" or entry is None:
            continue
        values = " | ".join(f"{entry['median_s'].get(p, 0.0):.2f}" for p in phases)
        breakdown.append(f"| {setup[1]} (fraction {setup[2]:g}) | {setup[3]} | {values} |")
    text = "\n".join(lines + ratios + breakdown) + "\n"
    Path(args.results, "table.md").write_text(text)
    print(text)


def cpu_ticks() -> dict[str, tuple[int, str]]:
    """Each process's user + system clock ticks and command line (Linux /proc)."""
    ticks = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        ticks[pid] = (int(fields[11]) + int(fields[12]), command)
    return ticks


def cpu(args: argparse.Namespace) -> None:
    hz = os.sysconf("SC_CLK_TCK")
    before, then = cpu_ticks(), time.time()
    while True:
        time.sleep(args.every)
        now_ticks, now = cpu_ticks(), time.time()
        bench, other, busiest = 0.0, 0.0, []
        for pid, (count, command) in now_ticks.items():
            cores = (count - before.get(pid, (0, ""))[0]) / hz / (now - then)
            if cores <= 0:
                continue
            if "kfac_kaisa.py worker" in command:
                bench += cores
            else:
                other += cores
                busiest.append((cores, command[:90]))
        top = "; ".join(f"{c:.2f} {command}" for c, command in sorted(busiest, reverse=True)[:2])
        stamp = time.strftime("%H:%M:%S", time.gmtime(now))
        print(f"{stamp} bench {bench:.2f} cores, other {other:.2f} cores; {top}", flush=True)
        before, then = now_ticks, now


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker", help="one configuration, under mpiexec")
    w.add_argument("--impl", choices=("kaisa", "mpisolve"), required=True)
    w.add_argument("--method", choices=("inverse", "eigen"), default="inverse")
    w.add_argument("--kind", choices=tuple(KINDS), default="inverse")
    w.add_argument("--batch", type=int, default=16)
    w.add_argument("--warmup", type=int, default=2)
    w.add_argument("--iters", type=int, default=3)
    w.add_argument("--variant", default="spd-kfac")
    w.add_argument("--grad-worker-fraction", type=float, default=0.0)
    w.add_argument("--port", type=int, default=29517)
    t = sub.add_parser("table", help="table.md from a results folder")
    t.add_argument("results")
    c = sub.add_parser("cpu", help="until stopped: cores used by the workers and by everything else")
    c.add_argument("--every", type=float, default=10.0, help="seconds between lines")
    args = parser.parse_args(argv)
    {"worker": worker, "table": table, "cpu": cpu}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
