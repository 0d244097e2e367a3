"""Where one tensor's sum above the inline size goes: ``mpisolve.allreduce`` against its parts.

Run under MPI (``mpiexec -n N python perf/one_tensor_paths.py --bytes ...``). Variants, each in
alternating blocks of back-to-back calls (``perf/one_tensor.py``'s protocol), per-call time of the
slowest rank, ratio to MPICH's ``Allreduce`` on kept numpy buffers:

- ``mpi``: ``comm.Allreduce(send, recv)`` on two kept numpy buffers;
- ``mpisolve``: ``mpisolve.allreduce(t, op="sum")`` as it is;
- ``inline``: the same on a communicator whose calls all go inline (the values and the flag in one
  persistent allreduce of a kept buffer: copy in, one start, copy out);
- ``kept``: one blocking ``Allreduce`` of the tensor's memory into a kept buffer, copied out (no flag);
- ``direct``: one blocking ``Allreduce`` of the tensor's memory into a new tensor (no flag, no copy).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI
from one_tensor import print_probes

import mpisolve
from mpisolve.comm import onetensor


def variants(nbytes: int, world: MPI.Intracomm, comm: mpisolve.Communicator) -> dict[str, Callable[[], object]]:
    numel = nbytes // 4
    send, recv = np.ones(numel, dtype=np.float32), np.empty(numel, dtype=np.float32)
    tensor = torch.ones(numel)
    host = tensor.numpy()
    kept = np.empty(numel, dtype=np.float32)
    inline_comm = comm.split(0, name=("one_tensor_paths", nbytes))
    state = onetensor.one_tensor(inline_comm)
    general = state.mode

    def inline_mode(t: torch.Tensor, op: str) -> str:
        return onetensor.GENERAL if general(t, op) == onetensor.GENERAL else onetensor.INLINE

    state.mode = inline_mode  # type: ignore[method-assign]
    for c in (comm, inline_comm):
        assert mpisolve.allreduce(tensor, op="sum", comm=c).eq(world.size).all()

    def kept_copy() -> torch.Tensor:
        world.Allreduce([host, MPI.FLOAT], [kept, MPI.FLOAT], MPI.SUM)
        return torch.from_numpy(kept.copy())

    def direct() -> torch.Tensor:
        out = torch.empty(numel)
        world.Allreduce([host, MPI.FLOAT], [out.numpy(), MPI.FLOAT], MPI.SUM)
        return out

    return {
        "mpi": lambda: world.Allreduce(send, recv),
        "mpisolve": lambda: mpisolve.allreduce(tensor, op="sum", comm=comm),
        "inline": lambda: mpisolve.allreduce(tensor, op="sum", comm=inline_comm),
        "kept": kept_copy,
        "direct": direct,
    }


if __name__ == "__main__":
    print_probes(__doc__, variants)
