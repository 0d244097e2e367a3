"""The GPU twin of :mod:`mpisolve.kernels.elastic` (numba.cuda, one thread per element)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from numba import cuda

from .dispatch import device_array
from .elastic import _check

if TYPE_CHECKING:
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

THREADS = 256


@cuda.jit
def _exchange(x: DeviceNDArray, center: DeviceNDArray, alpha: np.floating) -> None:
    j = cuda.grid(1)  # type: ignore[call-arg, var-annotated]  # numba types the intrinsic's call with its typing context
    if j < x.shape[0]:
        d = alpha * (x[j] - center[j])
        x[j] -= d
        center[j] += d


def _blocks(n: int) -> int:
    return max(1, -(-n // THREADS))


def launch_exchange(x: DeviceNDArray | np.ndarray, center: DeviceNDArray | np.ndarray, alpha: float) -> None:
    """Run the exchange kernel on arrays numba.cuda accepts (device arrays, or host arrays in tests)."""
    _exchange[_blocks(x.shape[0]), THREADS](x, center, x.dtype.type(alpha))


def elastic_exchange_(x: torch.Tensor, center: torch.Tensor, alpha: float) -> None:
    _check(x, center)
    launch_exchange(device_array(x), device_array(center), alpha)
