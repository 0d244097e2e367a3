"""The one way a solver asks for a collective it runs again and again.

:func:`reusable_sum`, :func:`reusable_allreduce` and :func:`reusable_bcast` return a
:class:`~.engine.Reusable` (``start``, ``test``, ``wait``, ``free``) and pick who runs it:
a node-shared sum where it applies (CPU tensors from the crossover up, several ranks per node: :mod:`.shm`),
the communicator's torch.distributed engine where it takes the tensor (NCCL for device
tensors, or gloo: :mod:`.engine`), else MPI (persistent collectives, direct or staged).
The caller never learns which answered. Collective: every rank asks in the same order.
"""

from __future__ import annotations

import torch

from .communicator import Communicator
from .engine import Reusable, TorchCollective
from .shm import NodePersistentAllreduce, node_group, node_path, takes


def reusable_sum(comm: Communicator, tensor: torch.Tensor) -> Reusable:
    """An in-place sum of ``tensor`` over ``comm``'s ranks, to start many times.

    Several of them in flight: complete them in the same order on every rank (node-shared
    rounds need it; see :mod:`.shm`'s "Completion order")."""
    group = node_group(comm)
    if group is not None and takes(comm, tensor) and node_path(group, tensor.numel() * tensor.element_size()):
        return NodePersistentAllreduce(group, tensor)
    return reusable_allreduce(comm, tensor, "sum")


def reusable_allreduce(comm: Communicator, tensor: torch.Tensor, op: str) -> Reusable:
    """An in-place ``op`` (sum, max, min) of ``tensor`` over ``comm``'s ranks by the engine (never node-shared)."""
    if comm.engine_takes(tensor):
        return TorchCollective(comm.torch_group(), tensor, comm.wait_for, op=op)
    return comm.persistent_allreduce(tensor, op)


def reusable_bcast(comm: Communicator, tensor: torch.Tensor, root: int = 0) -> Reusable:
    """A broadcast of ``tensor`` from ``root`` (a rank of ``comm``), to start many times."""
    if not 0 <= root < comm.size:
        raise ValueError(f"a broadcast's root must be a rank of the communicator (0 to {comm.size - 1}), got {root}")
    if comm.engine_takes(tensor):
        return TorchCollective(comm.torch_group(), tensor, comm.wait_for, root=root)
    return comm.persistent_bcast(tensor, root)
