"""GPU twin of ``triangle``: one CUDA thread per matrix entry (numba.cuda).

Imported only when a CUDA tensor reaches ``pack_triu`` or ``unpack_triu_``, which launch
on torch's current stream. ``pack_arrays`` and ``unpack_arrays`` take any arrays
numba.cuda accepts (and run under ``NUMBA_ENABLE_CUDASIM=1`` on the CPU, which is how
they are tested without a GPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from numba import cuda

from .dispatch import device_array, launch_stream, on_device
from .triangle import _check

if TYPE_CHECKING:
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

BLOCK = (16, 16)


@cuda.jit
def _pack_entries(matrix: DeviceNDArray, out: DeviceNDArray) -> None:
    i, j = cuda.grid(2)  # type: ignore[call-arg, var-annotated]  # numba types the intrinsic's call with its typing context
    n = matrix.shape[0]
    if i < n and i <= j < n:
        out[i * n - (i * (i - 1)) // 2 - i + j] = matrix[i, j]


@cuda.jit
def _unpack_entries(packed: DeviceNDArray, out: DeviceNDArray) -> None:
    i, j = cuda.grid(2)  # type: ignore[call-arg, var-annotated]  # numba types the intrinsic's call with its typing context
    n = out.shape[0]
    if i < n and j < n:
        a, b = (i, j) if i <= j else (j, i)
        out[i, j] = packed[a * n - (a * (a - 1)) // 2 - a + b]


def _grid(n: int) -> tuple[int, int]:
    return ((n + BLOCK[0] - 1) // BLOCK[0], (n + BLOCK[1] - 1) // BLOCK[1])


def pack_arrays(matrix: Any, out: Any, *, stream: Any = 0) -> None:
    """``out <- the row-major upper triangle of matrix`` (arrays numba.cuda accepts)."""
    _pack_entries[_grid(matrix.shape[0]), BLOCK, stream](matrix, out)


def unpack_arrays(packed: Any, out: Any, *, stream: Any = 0) -> None:
    """``out <- the symmetric matrix whose upper triangle is packed`` (arrays numba.cuda accepts)."""
    _unpack_entries[_grid(out.shape[0]), BLOCK, stream](packed, out)


def pack_triu(matrix: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """On torch's current stream, ordered after the work that produced ``matrix``."""
    _check(matrix, out)
    with on_device(matrix):
        pack_arrays(device_array(matrix), device_array(out), stream=launch_stream(matrix))
    return out


def unpack_triu_(packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """On torch's current stream, ordered after the work that produced ``packed``."""
    _check(out, packed)
    with on_device(packed):
        unpack_arrays(device_array(packed), device_array(out), stream=launch_stream(packed))
    return out
