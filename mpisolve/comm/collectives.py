"""Functional collectives on lists of tensors: ``mpisolve.allreduce``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from mpi4py import MPI

from .adasum import Adasum
from .buckets import FusedBuffer, wire_dtype
from .communicator import Communicator, Posting, as_communicator, mpi_buffer
from .device import Stager
from .shm import sum_once

REDUCE_OPS = ("sum", "average", "adasum")


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
    applies (:func:`.shm.sum_once`, which keeps a window per buffer size for the next call).
    ``op="adasum"`` combines each tensor by Adasum's rule instead (see
    :mod:`mpisolve.comm.adasum` for the order over any number of ranks).
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
    fused: list[tuple[list[int], FusedBuffer]] = []
    for (wire, device), members in groups.items():
        buf = FusedBuffer([tensors[i].shape for i in members], wire, device)
        buf.pack([tensors[i] for i in members])
        fused.append((members, buf))
    if op == "adasum":
        _adasum([buf.flat for _, buf in fused], [buf.numels for _, buf in fused], comm)
    elif not sum_once(comm, [buf.flat for _, buf in fused], f"allreduce of {len(tensors)} tensors"):
        stagers = [comm.stager(buf.flat) for _, buf in fused]
        postings = [_start_sum(comm, stager) for stager in stagers]
        comm.wait_posted(postings, f"allreduce of {len(tensors)} tensors")
        for stager in stagers:
            stager.from_mpi()
    out: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    for members, buf in fused:
        if op == "average":
            buf.flat.div_(comm.size)
        for i, view in zip(members, buf.views):
            out[i] = view if view.dtype == tensors[i].dtype else view.to(tensors[i].dtype)
    return out


def _start_sum(comm: Communicator, stager: Stager) -> Posting:
    """Start an in-place sum of ``stager``'s memory (posted once it is ready)."""
    stager.to_mpi()
    spec = mpi_buffer(stager.memory)
    posting = Posting([stager], lambda: comm.comm.Iallreduce(MPI.IN_PLACE, spec, MPI.SUM))
    comm.start(posting)
    return posting


def _adasum(flats: list[torch.Tensor], numels: list[list[int]], comm: Communicator) -> None:
    """Adasum every fused buffer in place, all in flight together."""
    adasum = Adasum(comm)
    reductions = [adasum.reduction(flat, sizes, tag=i) for i, (flat, sizes) in enumerate(zip(flats, numels))]
    try:
        for reduction in reductions:
            adasum.start(reduction)
        for reduction in reductions:
            adasum.finish(reduction)
    finally:
        for reduction in reductions:
            reduction.free()
