"""The GPU twin of :mod:`mpisolve.kernels.elastic` (numba.cuda, one thread per element).

Serves the windowed elastic solvers whose shared vector lives in GPU memory
(``window="device"``): the exchange runs on torch's current stream, after the kernels
that wrote the parameters and before MPI reads the center.
"""

from __future__ import annotations

from typing import Any

import torch
from numba import cuda

from .dispatch import device_array, launch_stream, on_device
from .elastic import _check

THREADS = 256


@cuda.jit
def _exchange(x, center, alpha):  # noqa: ANN001, ANN202 (CUDA kernel)
    j = cuda.grid(1)
    if j < x.shape[0]:
        d = alpha * (x[j] - center[j])
        x[j] -= d
        center[j] += d


def _blocks(n: int) -> int:
    return max(1, -(-n // THREADS))


def launch_exchange(x: Any, center: Any, alpha: float, *, stream: Any = 0) -> None:
    """Run the exchange kernel on arrays numba.cuda accepts."""
    _exchange[_blocks(x.shape[0]), THREADS, stream](x, center, x.dtype.type(alpha))


def elastic_exchange_(x: torch.Tensor, center: torch.Tensor, alpha: float) -> None:
    """``d = alpha (x - center); x -= d; center += d`` in one pass, on torch's current stream."""
    _check(x, center)
    if x.device != center.device:
        raise ValueError(f"x is on {x.device}, the center on {center.device}")
    with on_device(x):
        launch_exchange(device_array(x), device_array(center), alpha, stream=launch_stream(x))
