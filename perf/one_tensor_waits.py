"""How a rank waits for one small allreduce, where ranks outnumber cores: MPI's wait against polls from Python.

Run under MPI (``mpiexec -n 4 python perf/one_tensor_waits.py --bytes 4096``). Blocks of
``--calls`` back-to-back calls of each variant alternate for ``--blocks`` blocks, each
started by a barrier; a block's time per call is the slowest rank's. Rank 0 prints one line
per size: each variant's median per-call time over the blocks and its ratio to ``mpi``.
Why :mod:`mpisolve.comm.onetensor` waits with ``MPI_Wait`` where ranks share cores.

- ``mpi``: ``comm.Allreduce(send, recv)`` on numpy buffers kept across calls.
- ``mpisolve``: ``mpisolve.allreduce(t, op="sum")``.
- ``persistent_wait`` / ``_yield`` / ``_spin``: one start of a persistent allreduce
  (``MPI_Allreduce_init``) on a kept buffer, waited for by ``MPI_Wait``, by tests with
  ``sched_yield`` between them, or by tests alone.
- ``copy_wait`` / ``copy_yield``: the same with the tensor copied in and the sum copied out
  into a new tensor, as the one-tensor path does.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI
from one_tensor import print_probes

import mpisolve


def variants(nbytes: int, world: MPI.Intracomm, comm: mpisolve.Communicator) -> dict[str, Callable[[], object]]:
    """The waits compared, on ``nbytes`` of float32."""
    numel = nbytes // 4
    send, recv = np.ones(numel, dtype=np.float32), np.empty(numel, dtype=np.float32)
    buffer = np.zeros(numel + 1, dtype=np.float32)
    request = world.Dup().Allreduce_init(MPI.IN_PLACE, [buffer, MPI.FLOAT], MPI.SUM)
    tensor = torch.ones(numel)
    host = tensor.numpy()

    def wait() -> None:
        request.Wait()

    def yielding() -> None:
        while not request.Test():
            os.sched_yield()

    def spin() -> None:
        while not request.Test():
            pass

    def started(finish: Callable[[], None], copies: bool) -> Callable[[], object]:
        def call() -> object:
            if copies:
                buffer[:numel] = host
                buffer[numel] = 0
            request.Start()
            finish()
            return torch.from_numpy(buffer[:numel].copy()) if copies else None

        return call

    return {
        "mpi": lambda: world.Allreduce(send, recv),
        "mpisolve": lambda: mpisolve.allreduce(tensor, op="sum", comm=comm),
        "persistent_wait": started(wait, False),
        "persistent_yield": started(yielding, False),
        "persistent_spin": started(spin, False),
        "copy_wait": started(wait, True),
        "copy_yield": started(yielding, True),
    }


def main() -> None:
    print_probes(__doc__, variants)


if __name__ == "__main__":
    main()
