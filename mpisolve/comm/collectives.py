"""Functional collectives on lists of tensors: ``mpisolve.allreduce``."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from mpi4py import MPI

from .adasum import Adasum, AdasumReduction
from .buckets import wire_dtype
from .communicator import Communicator, Posting, as_communicator, mpi_buffer
from .device import Stager
from .flat import ONE_COPY_BYTES, FusedBuffer
from .shm import KeptWindows, kept_sums, sum_kept

REDUCE_OPS = ("sum", "average", "adasum")


@torch.no_grad()
def allreduce(
    tensors: Sequence[torch.Tensor],
    op: str = "average",
    comm: MPI.Comm | Communicator | None = None,
) -> list[torch.Tensor]:
    """Reduce a list of tensors of any shapes and float dtypes across ranks.

    Returns new tensors (the inputs are untouched) of the same shapes, dtypes and
    devices. The tensors are fused into one flat buffer per wire dtype and device
    (float16 and bfloat16 are reduced in float32), each reduced by one MPI allreduce,
    all in flight together. On a GPU, tensors of the wire dtype are fused by one kernel
    launch per 32 tensors on torch's current stream, and each buffer goes to MPI as
    ``comm.stager`` says (staged or directly, once the kernels that filled it are done).
    Sums of CPU tensors between ranks of one node go through node-shared memory where it
    applies (:func:`.shm.kept_sums`: the tensors are fused straight into a window kept per buffer
    size for the next call, and the sums copied out).
    ``op="adasum"`` combines each tensor by Adasum's rule instead (see
    :mod:`mpisolve.comm.adasum` for the order over any number of ranks; between ranks of
    one node it reads partners' pieces in node-shared memory where that applies, keeping
    a window per buffer layout for the next call).
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {', '.join(map(repr, REDUCE_OPS))}; got {op!r}")
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] is a {type(t).__name__}, not a torch.Tensor")
        if not t.is_floating_point():
            raise TypeError(f"tensors[{i}] has dtype {t.dtype}; allreduce takes floating-point tensors")
    comm = as_communicator(comm)
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((wire_dtype(t.dtype), t.device), []).append(i)
    sizes = [sum(tensors[i].numel() for i in members) for members in groups.values()]
    # Node-shared sums take their inputs where they lie (packed straight into the window), the results copied out.
    node = None if op == "adasum" else kept_sums(comm, [(n, w, d) for n, (w, d) in zip(sizes, groups)])
    flats = [
        _packed([tensors[i] for i in members], wire, device, None if node is None else node[k].input)
        for k, ((wire, device), members) in enumerate(groups.items())
    ]
    numels = [[tensors[i].numel() for i in members] for members in groups.values()]
    what = f"allreduce of {len(tensors)} tensors"
    if op == "adasum":
        _adasum(flats, numels, comm)
    elif node is not None:
        sum_kept(comm, node, what)
        flats = [kept.result.clone() for kept in node]  # the window is the next call's
    else:
        stagers = [comm.stager(flat) for flat in flats]
        postings = [_start_sum(comm, stager) for stager in stagers]
        comm.wait_posted(postings, what)
        for stager in stagers:
            stager.from_mpi()
    out: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    for members, flat, counts in zip(groups.values(), flats, numels):
        if op == "average":
            flat.div_(comm.size)
        pieces = [flat] if len(members) == 1 else flat.split(counts)
        for i, piece in zip(members, pieces):
            view = piece.view(tensors[i].shape)
            out[i] = view if view.dtype == tensors[i].dtype else view.to(tensors[i].dtype)
    return out


def _packed(
    tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device, flat: torch.Tensor | None
) -> torch.Tensor:
    """``tensors`` end to end in ``flat`` (as many elements; else a new tensor) of ``dtype`` on
    ``device``: under :data:`ONE_COPY_BYTES` in all by one torch copy (and cast), else by a
    :class:`FusedBuffer`'s pack (whose fused kernel copies large buffers faster)."""
    if sum(t.numel() for t in tensors) * dtype.itemsize >= ONE_COPY_BYTES:
        buf = FusedBuffer([t.shape for t in tensors], dtype, device, flat=flat)
        buf.pack(tensors)
        return buf.flat
    if flat is None:
        flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=device)
    if len(tensors) == 1:
        flat.view(tensors[0].shape).copy_(tensors[0])
    else:
        torch.cat([t.reshape(-1) for t in tensors], out=flat)
    return flat


def _start_sum(comm: Communicator, stager: Stager) -> Posting:
    """Start an in-place sum of ``stager``'s memory (posted once it is ready)."""
    stager.to_mpi()
    spec = mpi_buffer(stager.memory)
    posting = Posting([stager], lambda: comm.comm.Iallreduce(MPI.IN_PLACE, spec, MPI.SUM))
    comm.start(posting)
    return posting


class _KeptAdasum:
    """A communicator's Adasum for ``mpisolve.allreduce``, with its node-path reductions kept for the
    next call (:class:`.shm.KeptWindows`: each holds a node-shared window). The message path's are
    bound to the caller's buffer and freed after the call, as are those whose window would pass the
    bound on kept windows, which take the message path."""

    def __init__(self, comm: Communicator) -> None:
        self.adasum = Adasum(comm)
        group = self.adasum.topology.group
        self.kept: KeptWindows[tuple[int, int, torch.dtype, tuple[int, ...]], AdasumReduction] | None = (
            None if group is None else KeptWindows(group.keep_bytes)
        )
        comm.on_free(self.free)

    def reductions(self, flats: list[torch.Tensor], numels: list[list[int]]) -> list[AdasumReduction]:
        """Each fused buffer's reduction: on the node path, kept, for the buffers (in order) whose windows
        the bounds on kept windows hold together, asked for at once (so that none frees another's); the
        others on the message path, for this call."""
        wanted: list[tuple[tuple[int, int, torch.dtype, tuple[int, ...]], int]] = []  # (index, ...), bytes
        for index, flat in enumerate(flats):
            nbytes = self.adasum.window_bytes(flat)
            if (
                self.kept is not None
                and nbytes is not None
                and len(wanted) < self.kept.count
                and self.kept.fits(sum(b for _, b in wanted) + nbytes)
            ):
                wanted.append(((index, flat.numel(), flat.dtype, tuple(numels[index])), nbytes))
        node: dict[int, AdasumReduction] = {}
        if wanted:
            assert self.kept is not None
            made = self.kept.get(wanted, lambda key: self.adasum.reduction(flats[key[0]], numels[key[0]], tag=key[0]))
            node = {key[0]: reduction for (key, _), reduction in zip(wanted, made)}
        for index, reduction in node.items():
            reduction.flat = flats[index]  # the node path copies in from and out to it, whatever tensor it is
        return [
            node[index] if index in node else self.adasum.reduction(flat, sizes, tag=index, node_shared=False)
            for index, (flat, sizes) in enumerate(zip(flats, numels))
        ]

    def free(self) -> None:
        """Release the kept windows (collective over the node; run by ``comm.free()``)."""
        if self.kept is not None:
            self.kept.free()
        _KEPT.pop(self.adasum.comm, None)


_KEPT: weakref.WeakKeyDictionary[Communicator, _KeptAdasum] = weakref.WeakKeyDictionary()


def _adasum(flats: list[torch.Tensor], numels: list[list[int]], comm: Communicator) -> None:
    """Adasum every fused buffer in place, all in flight together (node-path reductions kept for the next call)."""
    kept = _KEPT.get(comm)
    if kept is None:
        kept = _KEPT[comm] = _KeptAdasum(comm)
    adasum = kept.adasum
    reductions = kept.reductions(flats, numels)
    try:
        for reduction in reductions:
            adasum.start(reduction)
        for reduction in reductions:
            adasum.finish(reduction)
    finally:
        for reduction in reductions:
            if reduction.node is None:
                reduction.free()
            elif not reduction.done and kept.kept is not None:  # a failed call: never started again (its
                kept.kept.forget(reduction)  # window goes with MPI)
