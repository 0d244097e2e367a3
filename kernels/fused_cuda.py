"""GPU twin of :mod:`mpisolve.kernels.fused`: pack and unpack as numba.cuda kernels.

One launch moves up to ``MAX_TENSORS`` tensors: they travel as a tuple of device arrays
with their offsets as a tuple of integers (kernel parameters, nothing allocated on the
device), block row ``y`` copies tensor ``y``, and the blocks of a row stride over the
tensor. Tuples are padded to a power of two so that few kernel variants get compiled.
Elements move as integers of their size, so any dtype goes. ``pack_arrays`` and
``unpack_arrays`` work on any ``__cuda_array_interface__`` arrays (and under
``NUMBA_ENABLE_CUDASIM=1`` on the CPU, which is how they are tested); ``pack`` and
``unpack`` take torch CUDA tensors and launch on torch's current stream.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from numba import cuda

from .dispatch import device_array, launch_stream, on_device
from .fused import layout

if TYPE_CHECKING:
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

THREADS = 256
#: Tensors per launch: 32 arrays of 7 kernel parameters each stay well within CUDA's 4 KiB limit.
MAX_TENSORS = 32
#: At most this many blocks per tensor; larger tensors are covered by striding.
MAX_BLOCKS = 1024

#: Kernels move raw elements as integers of the element's size (any dtype, bfloat16 too).
_UNITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_unit(dtype: torch.dtype) -> torch.dtype:
    """The integer type a kernel copies ``dtype``'s elements as (8-byte pieces of 16-byte ones)."""
    return _UNITS[math.gcd(dtype.itemsize, 8)]


def as_units(tensor: torch.Tensor, unit: torch.dtype) -> torch.Tensor:
    """``tensor``'s memory as a flat tensor of the integer copy unit (a view)."""
    return tensor.detach().reshape(-1).view(unit)


@cuda.jit
def _copy_kernel(
    arrays: tuple[DeviceNDArray, ...], offsets: tuple[int, ...], flat: DeviceNDArray, into_flat: bool
) -> None:
    """Block row ``y`` copies ``arrays[y]`` to or from ``flat[offsets[y]:]``, its blocks striding over it."""
    array = arrays[cuda.blockIdx.y]  # type: ignore[call-overload]  # numba stub: y is a property of a never-built class
    base = offsets[cuda.blockIdx.y]  # type: ignore[call-overload]  # numba stub: y is a property of a never-built class
    i = cuda.grid(1)  # type: ignore[call-arg, var-annotated]  # numba types the intrinsic's call with its typing context
    while i < array.shape[0]:
        if into_flat:
            flat[base + i] = array[i]
        else:
            array[i] = flat[base + i]
        i += cuda.gridsize(1)


def _copy_arrays(
    arrays: Sequence[Any], flat: Any, offsets: Sequence[int], into_flat: bool, stream: Any, max_blocks: int
) -> None:
    """Launch the copy over the non-empty arrays, ``MAX_TENSORS`` at a time."""
    work = [(a, int(o)) for a, o in zip(arrays, offsets) if a.shape[0] > 0]
    for first in range(0, len(work), MAX_TENSORS):
        group = work[first : first + MAX_TENSORS]
        padded = 1 << (len(group) - 1).bit_length()
        group_arrays = tuple(a for a, _ in group) + (group[0][0],) * (padded - len(group))
        group_offsets = tuple(o for _, o in group) + (0,) * (padded - len(group))
        longest = max(a.shape[0] for a, _ in group)
        grid = (min(max_blocks, (longest + THREADS - 1) // THREADS), len(group))
        _copy_kernel[grid, THREADS, stream](group_arrays, group_offsets, flat, into_flat)


def pack_arrays(
    sources: Sequence[Any], flat: Any, offsets: Sequence[int], *, stream: Any = 0, max_blocks: int = MAX_BLOCKS
) -> None:
    """Copy 1-D device arrays ``sources[j]`` into ``flat[offsets[j]:]`` (one dtype throughout)."""
    _copy_arrays(sources, flat, offsets, True, stream, max_blocks)


def unpack_arrays(
    flat: Any, targets: Sequence[Any], offsets: Sequence[int], *, stream: Any = 0, max_blocks: int = MAX_BLOCKS
) -> None:
    """Copy ``flat[offsets[j]:]`` into 1-D device arrays ``targets[j]`` (one dtype throughout)."""
    _copy_arrays(targets, flat, offsets, False, stream, max_blocks)


def _copy(tensors: Sequence[torch.Tensor], flat: torch.Tensor, into_flat: bool) -> None:
    """Copy between CUDA ``tensors`` and ``flat`` as the copy unit, on torch's current stream."""
    for i, t in enumerate(tensors):
        if t.device != flat.device:
            raise ValueError(f"tensor {i} is on {t.device}, the flat buffer on {flat.device}")
    unit = copy_unit(flat.dtype)
    offsets = (layout(tensors, flat)[:-1] // unit.itemsize).tolist()
    with on_device(flat):
        arrays = [device_array(as_units(t, unit)) for t in tensors]
        flat_array = device_array(as_units(flat, unit))
        _copy_arrays(arrays, flat_array, offsets, into_flat, launch_stream(flat), MAX_BLOCKS)


def pack(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy contiguous CUDA ``tensors`` end to end into ``flat``, ordered on torch's current stream."""
    _copy(tensors, flat, True)


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat``'s consecutive pieces into contiguous CUDA ``tensors``, on torch's current stream."""
    _copy(tensors, flat, False)
