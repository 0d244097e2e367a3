"""The GPU twin of :mod:`mpisolve.kernels.elastic` (numba.cuda, one thread per element).

Serves the windowed elastic solvers whose shared vector lives in GPU memory
(``window="device"``): the exchange runs on torch's current stream, after the kernels
that wrote the parameters and before MPI reads the center.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from numba import cuda

from .dispatch import device_array, launch_stream, on_device
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


def launch_exchange(
    x: DeviceNDArray | np.ndarray, center: DeviceNDArray | np.ndarray, alpha: float, *, stream: Any = 0
) -> None:
    """Run the exchange kernel on arrays numba.cuda accepts (device arrays, or host arrays in tests)."""
    _exchange[_blocks(x.shape[0]), THREADS, stream](x, center, x.dtype.type(alpha))


def elastic_exchange_(x: torch.Tensor, center: torch.Tensor, alpha: float) -> None:
    """``d = alpha (x - center); x -= d; center += d`` in one pass, on torch's current stream."""
    _check(x, center)
    if x.device != center.device:
        raise ValueError(f"x is on {x.device}, the center on {center.device}")
    with on_device(x):
        launch_exchange(device_array(x), device_array(center), alpha, stream=launch_stream(x))
