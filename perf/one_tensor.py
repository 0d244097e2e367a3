"""``mpisolve.allreduce`` of one float32 tensor against mpi4py's ``comm.Allreduce`` on a numpy buffer.

Run under MPI (``mpiexec -n N python perf/one_tensor.py``). For each size, blocks of
``--calls`` back-to-back calls of each variant alternate for ``--blocks`` blocks (so that
outside load falls on both alike), each block started by a barrier and timed on every rank;
a block's time per call is the slowest rank's. Rank 0 prints one JSON line per size: the
median per-call time of each variant over the blocks and their ratio (the issue-33 figure:
``mpisolve.allreduce`` of one 4 KiB tensor within 1.5x of MPICH's at 2 and 4 ranks).

- ``mpi``: ``comm.Allreduce(send, recv)`` on two numpy buffers kept across calls.
- ``mpisolve``: ``mpisolve.allreduce(t, op="sum")``, a new tensor each call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI

import mpisolve


def block_seconds(fn: Callable[[], object], calls: int, comm: MPI.Intracomm) -> float:
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return float(comm.allreduce((time.perf_counter() - start) / calls, op=MPI.MAX))


def alternating_medians(
    variants: dict[str, Callable[[], object]], calls: int, blocks: int, comm: MPI.Intracomm
) -> dict[str, float]:
    """Each variant's median seconds a call over ``blocks`` alternating blocks, after one warm-up block each."""
    for fn in variants.values():
        block_seconds(fn, calls, comm)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(blocks):
        for name, fn in variants.items():
            times[name].append(block_seconds(fn, calls, comm))
    return {name: statistics.median(t) for name, t in times.items()}


def parse_arguments(description: str | None, *, blocks: int) -> argparse.Namespace:
    """The sizes, calls per block and alternating blocks of a one-tensor timing script."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--bytes", type=int, nargs="+", default=[4096])
    parser.add_argument("--calls", type=int, default=200, help="calls per block")
    parser.add_argument("--blocks", type=int, default=blocks, help="alternating blocks of each variant")
    return parser.parse_args()


Variants = Callable[[int, MPI.Intracomm, "mpisolve.Communicator"], dict[str, Callable[[], object]]]


def print_probes(description: str | None, variants: Variants) -> None:
    """A probe script's run: per size, the median microseconds of each of ``variants(bytes, world, comm)``
    in alternating blocks, and its ratio to the ``"mpi"`` variant, printed on rank 0."""
    args = parse_arguments(description, blocks=10)
    world = MPI.COMM_WORLD
    comm = mpisolve.init()
    for nbytes in args.bytes:
        seconds = alternating_medians(variants(nbytes, world, comm), args.calls, args.blocks, world)
        medians = {name: s * 1e6 for name, s in seconds.items()}
        if world.rank == 0:
            shown = " ".join(f"{k}={v:.1f}us({v / medians['mpi']:.2f}x)" for k, v in medians.items())
            print(
                f"ranks={world.size} nodes={comm.nodes} bytes={nbytes} {shown} load={os.getloadavg()[0]:.1f}",
                flush=True,
            )


def main() -> None:
    args = parse_arguments(__doc__, blocks=30)
    world = MPI.COMM_WORLD
    comm = mpisolve.init()
    for nbytes in args.bytes:
        numel = nbytes // 4
        send, recv = np.ones(numel, dtype=np.float32), np.empty(numel, dtype=np.float32)
        tensor = torch.ones(numel)
        assert mpisolve.allreduce(tensor, op="sum").eq(world.size).all()
        variants: dict[str, Callable[[], object]] = {
            "mpi": lambda send=send, recv=recv: world.Allreduce(send, recv),
            "mpisolve": lambda tensor=tensor: mpisolve.allreduce(tensor, op="sum", comm=comm),
        }
        medians = alternating_medians(variants, args.calls, args.blocks, world)
        if world.rank == 0:
            line = {
                "ranks": world.size,
                "bytes": nbytes,
                "mpi_us": medians["mpi"] * 1e6,
                "mpisolve_us": medians["mpisolve"] * 1e6,
                "ratio": medians["mpisolve"] / medians["mpi"],
                "load_average": list(os.getloadavg()),
            }
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
