"""Where a small gradient bucket's round goes: the bucket path against MPI's own round and MPICH's call.

Run under MPI (``mpiexec -n N python perf/bucket_round_parts.py --bytes ...``; for the emulated
clusters add ``-launcher ssh -launcher-exec tests/cluster/fake-ssh -hosts a:2,b:2``). Variants, each
in alternating blocks of back-to-back calls (``perf/one_tensor.py``'s protocol), per-call time of the
slowest rank, ratio to MPICH's ``Allreduce`` on kept numpy buffers:

- ``mpi``: ``comm.Allreduce(send, recv)`` on two kept numpy buffers;
- ``persistent``: MPI's persistent allreduce of a kept buffer, ``Start`` then ``Wait``: MPI's own round;
- ``reusable``: the same through :class:`~mpisolve.comm.communicator.PersistentAllreduce` (``start``, then
  ``wait`` in ``MPI_Wait`` where the communicator allows it), the engine's round;
- ``spin3``, ``spin6``: ``persistent`` after 3 and 6 microseconds of busy work on each rank: what a
  microsecond of a rank's own work adds to the round where ranks share cores;
- ``buckets_sum``, ``buckets_average``: ``GradientBuckets.rearm()`` then ``finish()`` on one bucket of
  the tensor (the sum, and the average the solvers take): the bucket path, ``bench sweep``'s ``bucketed``.

Node-shared sums apply where they would in a job (set ``MPISOLVE_NODE_SHM=0`` to keep MPI's path);
rank 0 also prints which reducer the buckets took.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI
from one_tensor import print_probes

import mpisolve
from mpisolve.comm.buckets import GradientBuckets
from mpisolve.comm.communicator import mpi_buffer


def busy(microseconds: float) -> None:
    end = time.perf_counter_ns() + microseconds * 1000
    while time.perf_counter_ns() < end:
        pass


def variants(nbytes: int, world: MPI.Intracomm, comm: mpisolve.Communicator) -> dict[str, Callable[[], object]]:
    numel = nbytes // 4
    send, recv = np.ones(numel, dtype=np.float32), np.empty(numel, dtype=np.float32)
    kept = torch.ones(numel)
    request = world.Allreduce_init(MPI.IN_PLACE, mpi_buffer(kept), MPI.SUM)
    reusable = comm.persistent_allreduce(torch.ones(numel), "sum")
    buckets = {}
    for average in (False, True):
        param = torch.nn.Parameter(torch.zeros(numel))
        buckets[average] = GradientBuckets([param], comm, bucket_bytes=nbytes, average=average)
    if world.rank == 0:
        print(f"bytes={nbytes}: buckets take {type(buckets[True].reducer).__name__}", flush=True)
    atexit.register(request.Free)  # before MPI's own finalization, registered earlier
    atexit.register(reusable.free)
    for grads in buckets.values():
        atexit.register(grads.close)

    def persistent() -> None:  # MPI writes ``kept``: this closure keeps it alive while the request is
        request.Start()
        request.Wait()
        assert kept.numel() == numel

    def spun(microseconds: float) -> Callable[[], None]:
        def run() -> None:
            busy(microseconds)
            persistent()

        return run

    def engine() -> None:
        reusable.start()
        reusable.wait("reusable allreduce", in_mpi=True)

    def bucket_round(average: bool) -> Callable[[], None]:
        grads = buckets[average]

        def run() -> None:
            grads.rearm()
            grads.finish()

        return run

    return {
        "mpi": lambda: world.Allreduce(send, recv),
        "persistent": persistent,
        "reusable": engine,
        "spin3": spun(3.0),
        "spin6": spun(6.0),
        "buckets_sum": bucket_round(False),
        "buckets_average": bucket_round(True),
    }


if __name__ == "__main__":
    print_probes(__doc__, variants)
