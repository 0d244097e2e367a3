"""The GPU twin of :mod:`mpisolve.kernels.elastic` (numba.cuda, one thread per element)."""

from __future__ import annotations

import torch
from numba import cuda

from .dispatch import device_array
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


def launch_exchange(x, center, alpha) -> None:  # noqa: ANN001 (device arrays, or host arrays in tests)
    """Run the exchange kernel on arrays numba.cuda accepts."""
    _exchange[_blocks(x.shape[0]), THREADS](x, center, x.dtype.type(alpha))


def elastic_exchange_(x: torch.Tensor, center: torch.Tensor, alpha: float) -> None:
    _check(x, center)
    launch_exchange(device_array(x), device_array(center), alpha)
