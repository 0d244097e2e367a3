"""Every solver's training step on a GPU with torch's sync debug mode on: where does the host wait?

``python -m mpi4py -m perf.gpu.sync_check [--model resnet18] [--batch 32] [--steps 8] [--mode error]``,
from the repository root (under ``mpiexec -n N`` for N ranks). For each registered solver:
warm-up steps, then ``--steps`` steps (``solver.zero_grad()``, forward, backward,
``solver.step()``) each under ``torch.cuda.set_sync_debug_mode(mode)``. mpisolve's one
read of a step (:mod:`mpisolve.comm.readback`) is allowed inside that mode; anything else
that makes the host wait for the device raises (``error``) or warns (``warn``: counted).
K-FAC runs with ``factor_update_steps=2`` and ``inv_update_steps=4``, so that ordinary,
factor and inversion steps are each checked; they are reported apart.

Rank 0 prints one JSON line per solver: per kind of step, how many passed, the counted
reads per step, and the first error or warning. With several ranks use ``--mode warn``:
an error on one rank would leave the others in a collective.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings
from collections import defaultdict
from typing import Any

import torch
from torch import nn

import mpisolve
from mpisolve.bench.allreduce import MODEL_INPUTS
from mpisolve.comm.readback import host_reads
from mpisolve.train.models import build_model

KFAC = {"factor_update_steps": 2, "inv_update_steps": 4}


def kind_of(name: str, step: int) -> str:
    if name != "kfac":
        return "step"
    if step % KFAC["inv_update_steps"] == 0:
        return "inversion"
    return "factor" if step % KFAC["factor_update_steps"] == 0 else "ordinary"


def check(name: str, args: argparse.Namespace, comm: mpisolve.Communicator) -> dict[str, Any]:
    shape, classes = MODEL_INPUTS[args.model]
    cuda = comm.device.type == "cuda"  # without one, a dry run of this script on the CPU

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    torch.manual_seed(0)
    model = build_model(args.model, shape, classes).to(comm.device)
    own_momentum = name in ("async-msgd", "async-measgd")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.0 if own_momentum else 0.9)
    solver = mpisolve.make_solver(name, model, optimizer, comm, **(KFAC if name == "kfac" else {}))
    x = torch.randn(args.batch, *shape, device=comm.device)
    y = torch.randint(0, classes, (args.batch,), device=comm.device)
    found: dict[str, dict[str, Any]] = defaultdict(lambda: {"steps": 0, "passed": 0, "reads": [], "first": None})
    for step in range(args.warmup + args.steps):
        checked = step >= args.warmup
        kind = kind_of(name, getattr(solver, "steps", step))
        synchronize()
        before = host_reads()
        problem = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if checked and cuda:
                torch.cuda.set_sync_debug_mode(args.mode)
            try:
                solver.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                solver.step()
            except RuntimeError as err:  # where in mpisolve it happened, then the message
                frames = [f for f in traceback.extract_tb(err.__traceback__) if "mpisolve" in f.filename]
                where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(frames[-4:]))
                problem = f"{type(err).__name__} at {where}: {err}"
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode(0)
        syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
        if problem is None and syncs:
            problem = f"{len(syncs)} warnings: {syncs[0]}"
        if not checked:
            if problem is not None:
                found["warm-up"]["first"] = problem[:2000]
                break  # an error left the step half done: the solver's state is not to be trusted
            continue
        record = found[kind]
        record["steps"] += 1
        record["reads"].append(host_reads() - before)
        if problem is None:
            record["passed"] += 1
        elif record["first"] is None:
            record["first"] = problem[:2000]
        if problem is not None and args.mode == "error":
            break
    synchronize()
    try:
        solver.close()
    except Exception as err:  # a solver whose step raised may not close cleanly; the report says why
        found["close"]["first"] = f"{type(err).__name__}: {err}"[:500]
    return {"solver": name, "ranks": comm.size, "mode": args.mode, "model": args.model, **found}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18", choices=sorted(MODEL_INPUTS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--mode", default="error", choices=("error", "warn"))
    parser.add_argument("--solvers", default="all", help="comma-separated names, or all")
    args = parser.parse_args(argv)
    comm = mpisolve.init()
    names = mpisolve.solver_names() if args.solvers == "all" else args.solvers.split(",")
    failed = []
    for name in names:
        result = check(name, args, comm)
        clean = all(r["passed"] == r["steps"] for k, r in result.items() if isinstance(r, dict) and "steps" in r)
        if not clean:
            failed.append(name)
        if comm.rank == 0:
            print(json.dumps(result), flush=True)
    if comm.rank == 0:
        print(json.dumps({"sync_check_failed": failed}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
