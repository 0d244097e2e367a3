"""GPU twins of ``adasum.py``'s kernels, in numba.cuda (imported only for CUDA tensors).

Statistics: each block covers a tile of ``THREADS * ITEMS`` consecutive elements, its
threads striding through the tile with coalesced reads. A thread finds its first
element's segment by binary search, then walks forward through the segments its
elements cross, accumulating in float64 and adding each segment's partial sums into
``out`` with one atomic add per quantity. Combine: one thread per element (grid-stride),
its segment found by binary search, its coefficients computed from the summed stats.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from numba import cuda

from .adasum import _check, _check_codes, _check_counts, lower_share, pair_coefficient, side_count
from .dispatch import device_array, launch_stream, on_device

if TYPE_CHECKING:
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    _Array = DeviceNDArray

#: Threads per block and elements per thread in the statistics pass.
THREADS = 128
ITEMS = 8


@cuda.jit(device=True, inline=True)
def _segment_of(bounds: DeviceNDArray, index: int) -> int:
    """The segment holding ``index``: the last t with bounds[t] <= index (t < T)."""
    lo = 0
    hi = bounds.shape[0] - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if bounds[mid] <= index:
            lo = mid
        else:
            hi = mid
    return lo


@cuda.jit(device=True, inline=True)
def _flush(out: DeviceNDArray, segment: int, dot: float, na: float, nb: float) -> None:
    # numba's stub declares atomic.add as a class taking no arguments; in a kernel it is the atomic add.
    cuda.atomic.add(out, (segment, 0), dot)  # type: ignore[call-arg]  # numba stub: see above
    cuda.atomic.add(out, (segment, 1), na)  # type: ignore[call-arg]  # numba stub: see above
    cuda.atomic.add(out, (segment, 2), nb)  # type: ignore[call-arg]  # numba stub: see above


@cuda.jit
def _stats_kernel(a: DeviceNDArray, b: DeviceNDArray, bounds: DeviceNDArray, out: DeviceNDArray) -> None:
    n = a.shape[0]
    first = cuda.blockIdx.x * cuda.blockDim.x * ITEMS + cuda.threadIdx.x  # type: ignore[operator]  # numba stub: x is a property of a never-built class
    if first >= n:
        return
    segment = _segment_of(bounds, first)
    dot = 0.0
    na = 0.0
    nb = 0.0
    for j in range(ITEMS):
        i = first + j * cuda.blockDim.x  # type: ignore[operator]  # numba stub: x is a property of a never-built class
        if i >= n:
            break
        if i >= bounds[segment + 1]:
            _flush(out, segment, dot, na, nb)
            dot = 0.0
            na = 0.0
            nb = 0.0
            while i >= bounds[segment + 1]:
                segment += 1
        x = np.float64(a[i])
        y = np.float64(b[i])
        dot += x * y
        na += x * x
        nb += y * y
    _flush(out, segment, dot, na, nb)


# The CPU kernels' per-segment rules, compiled for the device from the same Python.
_coefficient = cuda.jit(device=True, inline=True)(pair_coefficient.py_func)
_side_count = cuda.jit(device=True, inline=True)(side_count.py_func)
_lower_share = cuda.jit(device=True, inline=True)(lower_share.py_func)


@cuda.jit
def _combine_kernel(a: _Array, b: _Array, bounds: _Array, stats: _Array, counts: _Array, out: _Array) -> None:
    start, stride = cuda.grid(1), cuda.gridsize(1)  # type: ignore[call-arg, var-annotated]  # numba types the intrinsic's call with its typing context
    for i in range(start, a.shape[0], stride):
        t = _segment_of(bounds, i)
        share = _lower_share(_side_count(counts[t, 0], stats[t, 1]), _side_count(counts[t, 1], stats[t, 2]))
        ca = _coefficient(stats[t, 0], stats[t, 1], share)
        cb = _coefficient(stats[t, 0], stats[t, 2], 1.0 - share)
        out[i] = ca * a[i] + cb * b[i]


@cuda.jit
def _codes_kernel(stats: DeviceNDArray, counts: DeviceNDArray, out: DeviceNDArray) -> None:
    start, stride = cuda.grid(1), cuda.gridsize(1)  # type: ignore[call-arg, var-annotated]  # numba types the intrinsic's call with its typing context
    for t in range(start, stats.shape[0], stride):
        out[t] = _side_count(counts[t, 0], stats[t, 1]) + _side_count(counts[t, 1], stats[t, 2]) + 1.0


def stats_arrays(
    a: DeviceNDArray, b: DeviceNDArray, bounds: DeviceNDArray, out: DeviceNDArray, *, stream: Any = 0
) -> None:
    """:func:`segment_stats` on numba device arrays; ``out`` must hold zeros."""
    n = a.shape[0]
    if n:
        _stats_kernel[math.ceil(n / (THREADS * ITEMS)), THREADS, stream](a, b, bounds, out)


def combine_arrays(
    a: DeviceNDArray,
    b: DeviceNDArray,
    bounds: DeviceNDArray,
    stats: DeviceNDArray,
    counts: DeviceNDArray,
    out: DeviceNDArray,
    *,
    stream: Any = 0,
) -> None:
    """:func:`segment_combine` on numba device arrays."""
    n = a.shape[0]
    if n:
        _combine_kernel[min(math.ceil(n / THREADS), 4096), THREADS, stream](a, b, bounds, stats, counts, out)


def segment_stats(a: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """GPU twin of :func:`mpisolve.kernels.adasum.segment_stats`, on torch's current stream."""
    _check(a, b, bounds, out)
    out.zero_()
    with on_device(a):
        arrays = [device_array(t) for t in (a, b, bounds, out)]
        stats_arrays(*arrays, stream=launch_stream(a))
    return out


def segment_combine(
    a: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor, stats: torch.Tensor, counts: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """GPU twin of :func:`mpisolve.kernels.adasum.segment_combine`, on torch's current stream."""
    _check(a, b, bounds, stats)
    _check_counts(stats, counts)
    with on_device(a):
        arrays = [device_array(t) for t in (a, b, bounds, stats, counts, out)]
        combine_arrays(*arrays, stream=launch_stream(a))
    return out


def combined_codes(stats: torch.Tensor, counts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """GPU twin of :func:`mpisolve.kernels.adasum.combined_codes`, on torch's current stream."""
    _check_codes(stats, counts, out)
    with on_device(stats):
        arrays = [device_array(t) for t in (stats, counts, out)]
        n = stats.shape[0]
        if n:
            _codes_kernel[math.ceil(n / THREADS), THREADS, launch_stream(stats)](*arrays)
    return out
