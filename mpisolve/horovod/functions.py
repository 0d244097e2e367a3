"""Horovod's helpers: broadcast a model's parameters, an optimizer's state, any picklable object."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..comm.state import broadcast_optimizer_state as broadcast_state_of
from .mpi_ops import ProcessSet, _same, _set_rank, _start, _world, global_process_set, synchronize


def broadcast_parameters(params: Any, root_rank: int, process_set: ProcessSet = global_process_set) -> None:
    """Overwrite ``params`` (``model.state_dict()``, ``named_parameters()`` or ``parameters()``)
    with ``root_rank``'s values, in place on every rank."""
    if isinstance(params, dict):
        tensors = [t for _, t in sorted(params.items())]
    elif isinstance(params, Iterable):
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params).__name__}")
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not tensors:
        return

    synchronize(_start("broadcast", tensors, process_set, _same, root=_set_rank(root_rank, process_set), out=tensors))


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyperparameters (the root's
    ``state_dict``: its structure pickled, its tensors in one broadcast)."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    broadcast_state_of(optimizer, _world(), root_rank)


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Any:
    """``root_rank``'s ``obj`` (pickled) on every rank of the set."""
    comm = process_set.comm if process_set.process_set_id else _world()
    if comm is None:
        raise ValueError(f"this rank is not in process set {process_set.process_set_id}")
    return comm.bcast_object(obj, root=_set_rank(root_rank, process_set))


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's ``obj`` (pickled), in rank order."""
    comm = process_set.comm if process_set.process_set_id else _world()
    if comm is None:
        raise ValueError(f"this rank is not in process set {process_set.process_set_id}")
    return comm.allgather_object(obj)
