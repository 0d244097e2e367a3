"""Fused-buffer pack and unpack: many tensors <-> one flat buffer, laid end to end.

``pack(tensors, flat)`` copies each tensor into ``flat`` at the running offset (the
layout of :class:`mpisolve.comm.flat.FusedBuffer`), ``unpack(flat, tensors)`` copies
back. Both copy bytes (no casting): every tensor must be contiguous and of ``flat``'s
dtype. The CPU twin is one Numba call over all tensors, split into equal chunks of the
flat range so that threads share a few large tensors as evenly as many small ones; it
reaches each tensor by its address (no array object per tensor) and copies with
memcpy. The GPU twin (``fused_cuda``) is one kernel launch per 32 tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .caching import CACHE
from .dispatch import BenchCase, by_device, parallel_threads

if TYPE_CHECKING:
    from llvmlite import ir  # type: ignore[import-untyped]  # llvmlite ships no type information
    from numba.core.base import BaseContext as TargetContext
    from numba.core.typing.context import BaseContext as TypingContext
    from numba.core.typing.templates import Signature

#: Bytes of the flat range one thread copies at a time.
CHUNK = 1 << 20
#: Below this many bytes one thread copies everything: a parallel region costs more
#: (and waits for its slowest thread, which on a busy node can be a scheduler slice).
PARALLEL_MIN = 4 * CHUNK


def layout(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> np.ndarray:
    """Check ``tensors`` against ``flat`` and return their end-to-end byte offsets (and the end)."""
    if not flat.is_contiguous():
        raise ValueError("the flat buffer must be contiguous")
    itemsize = flat.element_size()
    offsets = [0]
    for i, t in enumerate(tensors):
        if t.is_cpu != flat.is_cpu:
            raise ValueError(f"tensor {i} is on {t.device}, the flat buffer on {flat.device}")
        if t.dtype != flat.dtype:
            raise ValueError(f"tensor {i} has dtype {t.dtype}, the flat buffer {flat.dtype}: pack does not cast")
        if not t.is_contiguous():
            raise ValueError(f"tensor {i} is not contiguous")
        offsets.append(offsets[-1] + t.numel() * itemsize)
    if offsets[-1] > flat.numel() * itemsize:
        raise ValueError(f"the tensors hold {offsets[-1] // itemsize} elements, the flat buffer only {flat.numel()}")
    return np.array(offsets, dtype=np.int64)


@intrinsic
def _memcpy(
    typingctx: TypingContext, destination: types.Integer, source: types.Integer, nbytes: types.Integer
) -> tuple[Signature, Callable[[TargetContext, ir.IRBuilder, Signature, list[ir.Value]], ir.Constant]]:
    """memcpy between integer addresses (LLVM's memcpy: the C library's speed)."""

    def codegen(
        context: TargetContext, builder: ir.IRBuilder, signature: Signature, args: list[ir.Value]
    ) -> ir.Constant:
        destination, source, nbytes = args
        cgutils.raw_memcpy(
            builder,
            builder.inttoptr(destination, cgutils.voidptr_t),
            builder.inttoptr(source, cgutils.voidptr_t),
            nbytes,
            1,
        )
        return context.get_dummy_value()

    return types.none(types.intp, types.intp, types.intp), codegen


@njit(nogil=True, cache=CACHE)
def _copy_chunk(addresses: np.ndarray, offsets: np.ndarray, flat: int, into_flat: bool, chunk: int) -> None:
    """Copy bytes ``[chunk * CHUNK, (chunk + 1) * CHUNK)`` of ``flat`` from or to the tensors.

    Tensor ``j`` sits at bytes ``offsets[j]:offsets[j+1]`` of ``flat`` and at
    ``addresses[j]``. The chunk finds its first tensor by binary search and walks on, so
    chunks are equal work whatever the tensor sizes.
    """
    lo = chunk * CHUNK
    hi = min(lo + CHUNK, offsets[-1])
    j = np.searchsorted(offsets, lo, side="right") - 1
    while lo < hi:
        end = min(hi, offsets[j + 1])
        if end > lo:
            inside = addresses[j] + lo - offsets[j]
            if into_flat:
                _memcpy(flat + lo, inside, end - lo)  # type: ignore[call-arg, arg-type]  # numba types the call with its typing context
            else:
                _memcpy(inside, flat + lo, end - lo)  # type: ignore[call-arg, arg-type]  # numba types the call with its typing context
        lo = end
        j += 1


@njit(nogil=True, cache=CACHE)
def _copy_serial(addresses: np.ndarray, offsets: np.ndarray, flat: int, into_flat: bool) -> None:
    for chunk in range((offsets[-1] + CHUNK - 1) // CHUNK):
        _copy_chunk(addresses, offsets, flat, into_flat, chunk)


@njit(nogil=True, cache=CACHE, parallel=True)
def _copy_parallel(addresses: np.ndarray, offsets: np.ndarray, flat: int, into_flat: bool) -> None:
    for chunk in prange((offsets[-1] + CHUNK - 1) // CHUNK):
        _copy_chunk(addresses, offsets, flat, into_flat, chunk)


def _copy_cpu(tensors: Sequence[torch.Tensor], flat: torch.Tensor, into_flat: bool) -> None:
    offsets = layout(tensors, flat)
    if offsets[-1] == 0:
        return
    addresses = np.array([t.data_ptr() for t in tensors], dtype=np.intp)
    if offsets[-1] >= PARALLEL_MIN and parallel_threads() > 1:
        _copy_parallel(addresses, offsets, flat.data_ptr(), into_flat)
    else:
        _copy_serial(addresses, offsets, flat.data_ptr(), into_flat)


def pack_cpu(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy contiguous CPU ``tensors`` end to end into ``flat`` (same dtype, no cast)."""
    _copy_cpu(tensors, flat, True)


def unpack_cpu(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat``'s consecutive pieces back into contiguous CPU ``tensors``."""
    _copy_cpu(tensors, flat, False)


pack = by_device(pack_cpu, "mpisolve.kernels.fused_cuda:pack")
pack.__doc__ = """Copy contiguous ``tensors`` end to end into ``flat`` (same dtype and device, no cast)."""
unpack = by_device(unpack_cpu, "mpisolve.kernels.fused_cuda:unpack")
unpack.__doc__ = """Copy ``flat``'s consecutive pieces back into contiguous ``tensors`` (same dtype and device)."""


def bench_sizes(numel: int, count: int) -> list[int]:
    """``count`` tensor sizes summing to ``numel``, unequal as a model's are (deterministic)."""
    if not 1 <= count <= numel:
        raise ValueError(f"cannot split {numel} elements into {count} non-empty tensors")
    weights = np.random.default_rng(0).pareto(1.0, count) + 1.0
    sizes = 1 + (weights / weights.sum() * (numel - count)).astype(np.int64)
    sizes[np.argmax(sizes)] += numel - sizes.sum()
    return [int(s) for s in sizes]


def bench_cases(numel: int, device: str | torch.device = "cpu") -> list[BenchCase]:
    """Pack against ``torch.cat(..., out=flat)`` and unpack against split-and-copy, few and many tensors."""
    return [case for count in (4, 200) for case in _bench_cases(bench_sizes(numel, min(count, numel)), device)]


def _bench_cases(sizes: list[int], device: str | torch.device) -> list[BenchCase]:
    tensors = [torch.randn(n, device=device) for n in sizes]
    views = [t.view(-1) for t in tensors]
    flat = torch.empty(sum(sizes), device=device)
    pieces = flat.split(sizes)

    def torch_unpack() -> None:
        for piece, t in zip(pieces, views):
            t.copy_(piece)

    label = f"{len(sizes)} tensors"
    return [
        BenchCase(f"pack {label}", kernel=lambda: pack(tensors, flat), reference=lambda: torch.cat(views, out=flat)),
        BenchCase(f"unpack {label}", kernel=lambda: unpack(flat, tensors), reference=torch_unpack),
    ]
