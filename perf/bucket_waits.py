"""Where a small gradient-bucket round goes: its wait against the step's bookkeeping.

Run under MPI (``mpiexec -n 4 python perf/bucket_waits.py --bytes 4096 65536``, or on the
emulated cluster of tests/cluster). One bucket of ``--bytes`` float32 gradients, as
``bench sweep``'s ``bucketed``; blocks of ``--calls`` back-to-back calls of each variant
alternate for ``--blocks`` blocks, each started by a barrier, a block's time per call the
slowest rank's (perf/one_tensor.py). Rank 0 prints one line per size: each variant's
median per-call time over the blocks and its ratio to ``mpi``.

- ``mpi``: MPICH's ``Allreduce`` on numpy buffers kept across calls.
- ``bucketed``: ``GradientBuckets.rearm()`` then ``finish()``, the solvers' round.
- ``bucketed_probe``: the same with ``finish(check_finite=True)`` (the finite probe).
- ``start_wait``: the bucket's persistent allreduce alone, started and completed by the
  reducer's own wait (the communicator's polled one, or ``MPI_Wait`` where it blocks).
- ``start_polled``: the same request completed by the communicator's polled wait.
- ``start_mpi_wait``: the same request completed by ``MPI_Wait`` under the watchdog thread.
- ``solver_bucketed``, ``solver_start_wait``: ``bucketed`` and ``start_wait`` on a bucket whose
  communicator carries a solver's close notices (:class:`~mpisolve.comm.closing.CloseNotices`,
  a round open), as the solvers' buckets: their wait is polled.
- ``solver_start_waitany``: that bucket's request completed by ``MPI_Waitany`` over it and one
  receive posted from each other rank, under the watchdog thread: how a solver's bucket wait
  would block in MPI and still wake for a close notice (no notice comes here).

"""

from __future__ import annotations

import atexit
from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI
from one_tensor import print_probes

import mpisolve
from mpisolve.comm.buckets import GradientBuckets, SumReducer
from mpisolve.comm.closing import CloseNotices


def variants(nbytes: int, world: MPI.Intracomm, comm: mpisolve.Communicator) -> dict[str, Callable[[], object]]:
    """The rounds compared, on ``nbytes`` of float32."""
    numel = nbytes // 4
    send, recv = np.ones(numel, dtype=np.float32), np.empty(numel, dtype=np.float32)
    param = torch.nn.Parameter(torch.zeros(numel))
    grads = GradientBuckets([param], comm, bucket_bytes=nbytes, average=True)
    assert isinstance(grads.reducer, SumReducer), "this probe times MPI's path (below the node crossover)"
    reducer = grads.reducer
    request = reducer.requests[0]

    def bucketed() -> None:
        grads.rearm()
        grads.finish()

    def bucketed_probe() -> None:
        grads.rearm()
        grads.finish(check_finite=True)

    def start_wait() -> None:
        reducer.start(grads.buckets[0])
        reducer.finish(grads.buckets[0])

    def start_polled() -> None:
        request.start()
        request.wait("probe")

    def start_mpi_wait() -> None:
        request.start()
        comm.wait_in_mpi(request.posting, "probe")

    solver_comm = comm.dup()
    CloseNotices(solver_comm, lambda: 0, "probe", "steps")  # never closed: it posts nothing
    solver_param = torch.nn.Parameter(torch.zeros(numel))
    solver_grads = GradientBuckets([solver_param], solver_comm, bucket_bytes=nbytes, average=True)
    assert isinstance(solver_grads.reducer, SumReducer)
    solver_reducer = solver_grads.reducer
    solver_request = solver_reducer.requests[0]

    def solver_bucketed() -> None:
        solver_grads.rearm()
        solver_grads.finish()

    def solver_start_wait() -> None:
        solver_reducer.start(solver_grads.buckets[0])
        solver_reducer.finish(solver_grads.buckets[0])

    notices = solver_comm.comm.Dup()
    inbox = np.zeros((world.size, 5), dtype=np.int64)
    receives = [
        notices.Irecv([inbox[rank], MPI.INT64_T], source=rank, tag=1)
        for rank in range(world.size)
        if rank != world.rank
    ]

    @atexit.register
    def withdraw() -> None:
        for receive in receives:
            receive.Cancel()
            receive.Wait()

    def solver_start_waitany() -> None:
        solver_request.start()
        solver_comm.post_ready()
        with solver_comm.blocking("probe"):
            while MPI.Request.Waitany([solver_request.posting.request, *receives]) != 0:
                pass

    return {
        "mpi": lambda: world.Allreduce(send, recv),
        "bucketed": bucketed,
        "bucketed_probe": bucketed_probe,
        "start_wait": start_wait,
        "start_polled": start_polled,
        "start_mpi_wait": start_mpi_wait,
        "rearm": grads.rearm,
        "solver_bucketed": solver_bucketed,
        "solver_start_wait": solver_start_wait,
        "solver_start_waitany": solver_start_waitany,
    }


def main() -> None:
    print_probes(__doc__, variants)


if __name__ == "__main__":
    main()
