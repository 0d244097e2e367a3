"""``bench soak``: long runs of the asynchronous solvers; memory must not grow, windows must be freed.

Each solver that is not lockstep (the EASGD family and the window solvers) trains
``--model`` (default the small CNN, 53k parameters) on its ``digits`` shard for
``--steps`` steps on every rank. Each rank reads its resident set size (VmRSS) after
``--warmup-steps`` and at the end; after ``close()`` it counts the MPI windows still
allocated in the process (mpi4py ``Win`` objects not yet freed) beyond those held before
the solver was built (a communicator keeps some for ``mpisolve.allreduce``).
Reported per solver: every rank's RSS in MB at both points, the largest growth, and the
windows it left open, summed over ranks (must be 0), and the run's seconds (rank 0's).
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.nn.functional as F
from mpi4py import MPI

from ..comm.communicator import Communicator
from ..errors import InputError
from ..solvers import make_solver, solver_names
from ..solvers.base import solver_class
from ..train.data import ShardStream, load_dataset
from ..train.models import build_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--solvers", default="async", help="comma-separated names, or 'async': every non-lockstep solver"
    )
    parser.add_argument("--steps", type=int, default=2000, help="training steps per rank and solver")
    parser.add_argument("--warmup-steps", type=int, default=200, help="steps before the first RSS reading")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--model", default="cnn", choices=("mlp", "cnn"), help="the model trained")


def rss_mb() -> float:
    """This process's resident set size, in MB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def open_windows() -> int:
    """MPI windows this process still holds (allocated and not freed)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is MPI.Win and o != MPI.WIN_NULL)


def run(args: argparse.Namespace, comm: Communicator) -> dict:
    names = (
        [n for n in solver_names() if not solver_class(n).lockstep]
        if args.solvers == "async"
        else args.solvers.split(",")
    )
    for name in names:
        solver_class(name)  # an unknown name fails here, naming the known ones
    if not 1 <= args.warmup_steps < args.steps or args.batch_size < 1:
        raise InputError("need 1 <= --warmup-steps < --steps and --batch-size >= 1")
    data = load_dataset("digits")
    result: dict = {
        "ranks": comm.size,
        "model": args.model,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "solvers": {},
    }
    for name in names:
        torch.manual_seed(0)
        model = build_model(args.model, data.in_shape, data.classes)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        held = open_windows()  # by others than this solver (a communicator's kept windows)
        solver = make_solver(name, model, optimizer, comm)
        shard = ShardStream(data.train, rank=comm.rank, size=comm.size, seed=0, batch_size=args.batch_size)
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            x, y = shard.next_batch()
            solver.zero_grad()
            F.cross_entropy(model(x), y).backward()
            solver.step()
            if step == args.warmup_steps:
                warm = rss_mb()
        end = rss_mb()
        seconds = time.perf_counter() - start
        solver.close()
        del solver, model, optimizer
        everyone = comm.allgather_object((warm, end, open_windows() - held))
        result["solvers"][name] = {
            "rss_warm_mb": [round(e[0], 1) for e in everyone],
            "rss_end_mb": [round(e[1], 1) for e in everyone],
            "max_growth_mb": round(max(e[1] - e[0] for e in everyone), 1),
            "open_windows": sum(e[2] for e in everyone),
            "seconds": round(seconds, 1),
        }
    return result
