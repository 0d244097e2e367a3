"""Making every rank start from the same model: the consistency check and rank 0's broadcast."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ModelMismatchError
from .communicator import Communicator
from .reusable import reusable_bcast


def model_signature(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every parameter, in registration order."""
    return [(name, tuple(p.shape), str(p.dtype).replace("torch.", "")) for name, p in model.named_parameters()]


def check_same_model(model: torch.nn.Module, comm: Communicator) -> None:
    """Raise :class:`ModelMismatchError` on every rank unless all ranks hold the same architecture.

    Ranks compare a digest first; only on a mismatch do they exchange the full
    signatures, so that every rank can name the first differing parameter and the ranks
    that differ from rank 0.
    """
    if comm.size == 1:
        return
    signature = model_signature(model)
    digest = hashlib.sha1(repr(signature).encode()).hexdigest()
    if len(set(comm.allgather_object(digest))) == 1:
        return
    raise ModelMismatchError(describe_mismatch(comm.allgather_object(signature)))


def describe_mismatch(signatures: Sequence[list[tuple[str, tuple[int, ...], str]]]) -> str:
    """One line naming the first parameter where some rank differs from rank 0, and those ranks."""
    reference = signatures[0]
    for i in range(max(len(s) for s in signatures)):
        ref = reference[i] if i < len(reference) else None
        differing = [r for r, s in enumerate(signatures) if (s[i] if i < len(s) else None) != ref]
        if differing:
            first = signatures[differing[0]]
            other = first[i] if i < len(first) else None
            name = ref[0] if ref is not None else other[0]  # type: ignore[index]
            return (
                f"model mismatch at parameter {i} ({name!r}): rank 0 has {_fmt(ref)}, "
                f"rank(s) {_ranks(differing)} have {_fmt(other)}"
            )
    return "model mismatch: parameter lists differ between ranks"


def _fmt(entry: tuple[str, tuple[int, ...], str] | None) -> str:
    if entry is None:
        return "no such parameter"
    name, shape, dtype = entry
    return f"{name!r} shape {list(shape)} {dtype}"


def _ranks(ranks: list[int]) -> str:
    return ",".join(str(r) for r in ranks)


def broadcast_tensors(tensors: Sequence[torch.Tensor], comm: Communicator, root: int = 0) -> None:
    """Overwrite ``tensors`` on every rank with ``root``'s values: one fused broadcast of their bytes."""
    tensors = [t for t in tensors if t.numel() > 0]
    if comm.size == 1 or not tensors:
        return
    # Each piece starts at a multiple of its element size, so it can be viewed as its dtype.
    offsets = []
    end = 0
    for t in tensors:
        start = -(-end // t.element_size()) * t.element_size()
        offsets.append(start)
        end = start + t.numel() * t.element_size()
    flat = torch.empty(end, dtype=torch.uint8)
    pieces = []
    for t, start in zip(tensors, offsets):
        piece = flat[start : start + t.numel() * t.element_size()]
        if comm.rank == root:
            piece.copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        pieces.append(piece)
    comm.bcast_(flat, root=root, what="broadcast of parameters and buffers")
    if comm.rank != root:
        with torch.no_grad():
            for t, piece in zip(tensors, pieces):
                t.copy_(piece.view(t.dtype).view(t.shape))


def broadcast_module_and_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, comm: Communicator, root: int = 0
) -> None:
    """Give every rank ``root``'s parameters, buffers and optimizer state."""
    if comm.size == 1:
        return
    broadcast_tensors([*model.parameters(), *model.buffers()], comm, root)
    if optimizer is not None:
        broadcast_optimizer_state(optimizer, comm, root)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, comm: Communicator, root: int = 0) -> None:
    """Load ``root``'s optimizer state everywhere: its structure as metadata, its tensors as bytes."""
    state = optimizer.state_dict() if comm.rank == root else None
    skeleton, tensors = _split_tensors(state) if state is not None else (None, [])
    skeleton = comm.bcast_object(skeleton, root=root)
    if comm.rank != root:
        tensors = []
        skeleton = _allocate(skeleton, tensors)
    broadcast_tensors(tensors, comm, root)
    if comm.rank != root:
        optimizer.load_state_dict(skeleton)


class _TensorSlot:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape = shape
        self.dtype = dtype


def _split_tensors(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []

    def walk(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            tensors.append(o.detach().contiguous())
            return _TensorSlot(tuple(o.shape), o.dtype)
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return type(o)(walk(v) for v in o)
        return o

    return walk(obj), tensors


def _allocate(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _TensorSlot):
        t = torch.empty(obj.shape, dtype=obj.dtype)
        tensors.append(t)
        return t
    if isinstance(obj, dict):
        return {k: _allocate(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_allocate(v, tensors) for v in obj)
    return obj


class BufferBroadcast:
    """Rank ``root``'s module buffers (BatchNorm running statistics) on every rank, one
    nonblocking broadcast per step.

    :meth:`start` (after a step) copies the root's buffers into one flat byte buffer and
    starts a persistent broadcast of it; :meth:`complete` (before the buffers are next
    read: the next forward, an evaluation, ``close``) waits for it and, off the root,
    copies the bytes into the buffers. So the ranks' buffers are the root's from the
    next forward on, as with DDP's ``broadcast_buffers``, with no blocking collective per
    forward and nothing allocated per step. Buffers replaced by new tensors (``model.to``)
    after construction are not followed: build the solver on the placed model.
    """

    def __init__(self, buffers: Sequence[torch.Tensor], comm: Communicator, root: int = 0) -> None:
        self.buffers = [b for b in buffers if b.numel() > 0]
        self.comm = comm
        self.root = root
        devices = {b.device for b in self.buffers}
        device = devices.pop() if len(devices) == 1 else torch.device("cpu")
        offsets, end = [], 0
        for b in self.buffers:  # each piece starts at a multiple of its element size
            start = -(-end // b.element_size()) * b.element_size()
            offsets.append(start)
            end = start + b.numel() * b.element_size()
        self.flat = torch.zeros(end, dtype=torch.uint8, device=device)
        self._pieces = [
            self.flat[o : o + b.numel() * b.element_size()].view(b.dtype).view(b.shape)
            for o, b in zip(offsets, self.buffers)
        ]
        self._request = reusable_bcast(comm, self.flat, root)
        self.pending = False

    @torch.no_grad()
    def start(self) -> None:
        """Collective: start broadcasting the root's buffers as they are now."""
        self.complete()
        if self.comm.rank == self.root:
            torch._foreach_copy_(self._pieces, self.buffers)
        self._request.start()
        self.pending = True

    @torch.no_grad()
    def complete(self) -> None:
        """Finish the broadcast in flight, if any: the buffers then hold the root's values."""
        if not self.pending:
            return
        self._request.wait("broadcast of rank 0's module buffers")
        self.pending = False
        if self.comm.rank != self.root:
            torch._foreach_copy_(self.buffers, self._pieces)

    def close(self) -> None:
        self.complete()
        self._request.free()
