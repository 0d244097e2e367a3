"""A model's gradient buckets of several sizes in one step, against MPICH's calls for the same buckets.

Run under MPI as ``perf/bucket_round_parts.py`` is (from ``perf/``; the emulated clusters with
``-launcher ssh -launcher-exec ../tests/cluster/fake-ssh -hosts a:2,b:2``). For each ``--bytes`` B the
model has three buckets, one parameter each: one of :data:`LARGE_BYTES` (above the crossover across
nodes) and two of B (a large model's last bucket and small layers). Variants, in alternating blocks
(``perf/one_tensor.py``'s protocol), per-call time of the slowest rank, ratio to ``mpi``:

- ``mpi``: ``comm.Allreduce(send, recv)`` of each bucket's bytes in turn, on kept numpy buffers;
- ``buckets``: ``GradientBuckets.rearm()`` then ``finish()`` of the model, averaging (the solvers'
  step), on the path the model's gradient bytes take (rank 0 prints each bucket's);
- ``small_mpi``, ``small_buckets``: the same for a model of the two small buckets alone.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI
from one_tensor import print_probes

import mpisolve
from mpisolve.comm.buckets import GradientBuckets

#: The large bucket's bytes: 2 MiB, above the 1 MiB crossover across nodes.
LARGE_BYTES = 2 * 1024 * 1024


def model_round(sizes: list[int], comm: mpisolve.Communicator, world: MPI.Intracomm) -> Callable[[], None]:
    params = [torch.nn.Parameter(torch.zeros(n // 4)) for n in reversed(sizes)]  # bucketed last to first
    grads = GradientBuckets(params, comm, bucket_bytes=max(sizes), average=True)
    assert [b.buffer.numel * 4 for b in grads.buckets] == sizes, "one parameter per bucket"
    if world.rank == 0:
        # Every bucket takes the model's path; e787d5e (measured by this probe, then reverted) had each take its own.
        on_node = [getattr(b, "on_node", grads.node is not None) for b in grads.buckets]
        paths = ", ".join(f"{n} B {'node-shared' if node else 'MPI'}" for n, node in zip(sizes, on_node))
        print(f"buckets: {paths}", flush=True)
    atexit.register(grads.close)

    def run() -> None:
        grads.rearm()
        grads.finish()

    return run


def mpi_calls(sizes: list[int], world: MPI.Intracomm) -> Callable[[], None]:
    buffers = [(np.ones(n // 4, dtype=np.float32), np.empty(n // 4, dtype=np.float32)) for n in sizes]

    def run() -> None:
        for send, recv in buffers:
            world.Allreduce(send, recv)

    return run


def variants(nbytes: int, world: MPI.Intracomm, comm: mpisolve.Communicator) -> dict[str, Callable[[], object]]:
    sizes, small = [nbytes, LARGE_BYTES, nbytes], [nbytes, nbytes]
    return {
        "mpi": mpi_calls(sizes, world),
        "buckets": model_round(sizes, comm, world),
        "small_mpi": mpi_calls(small, world),
        "small_buckets": model_round(small, comm, world),
    }


if __name__ == "__main__":
    print_probes(__doc__, variants)
