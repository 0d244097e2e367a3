"""One allreduce through mpisolve.horovod against mpisolve.allreduce, same tensors, same run.

Run under mpiexec (perf/horovod_step.sh). For each size, a float32 tensor averaged by
``mpisolve.allreduce`` and by ``hvd.allreduce`` (both, below the node-shared crossover,
:mod:`mpisolve.comm.onetensor`'s one MPI call with the signature check in it), timed in
turn within each repeat (``interleaved_medians``, the slowest rank's); each timing is
CALLS calls, reported per call. One JSON line per size. ``--others``: ``hvd.broadcast``,
``mpisolve.broadcast``, ``hvd.allgather`` and ``hvd.grouped_allreduce`` of one and of four
such tensors too, timed in the same turns (a group of one takes the one-tensor path; the
others, the checked collectives' header round).
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from typing import Any

import torch

import mpisolve
import mpisolve.horovod as hvd
from mpisolve.bench import interleaved_medians


def repeat(fn: Callable[[], Any], calls: int) -> None:
    for _ in range(calls):
        fn()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="4,4096,65536,1048576", help="bytes, comma-separated")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--others", action="store_true", help="also broadcasts, hvd.allgather and hvd.grouped_allreduce"
    )
    args = parser.parse_args()
    comm = mpisolve.init()
    hvd.init()
    for size in (int(s) for s in args.sizes.split(",")):
        t = torch.rand(max(1, size // 4))
        calls = max(1, args.calls if size < 1 << 20 else args.calls // 10)
        fns = {
            "native": functools.partial(repeat, lambda t=t: mpisolve.allreduce(t, op="average"), calls),
            "horovod": functools.partial(repeat, lambda t=t: hvd.allreduce(t), calls),
        }
        if args.others:
            fns["hvd_broadcast"] = functools.partial(repeat, lambda t=t: hvd.broadcast(t, 0), calls)
            fns["mpisolve_broadcast"] = functools.partial(repeat, lambda t=t: mpisolve.broadcast(t, 0), calls)
            fns["hvd_allgather"] = functools.partial(repeat, lambda t=t: hvd.allgather(t), calls)
            fns["hvd_grouped_allreduce_1"] = functools.partial(repeat, lambda t=t: hvd.grouped_allreduce([t]), calls)
            fns["hvd_grouped_allreduce_4"] = functools.partial(
                repeat, lambda t=t: hvd.grouped_allreduce([t] * 4), calls
            )
        timings = interleaved_medians(fns, comm, args.repeats, 2)
        if comm.rank == 0:
            row = {
                "bytes": t.numel() * 4,
                "ranks": comm.size,
                "mpisolve_allreduce_us": timings["native"] / calls * 1e6,
                "hvd_allreduce_us": timings["horovod"] / calls * 1e6,
                "hvd_over_mpisolve": timings["horovod"] / timings["native"],
            }
            row.update({f"{name}_us": timings[name] / calls * 1e6 for name in fns if name not in ("native", "horovod")})
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
