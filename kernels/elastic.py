"""The elastic exchange of asynchronous EASGD and EA-wild, in one pass over memory.

``elastic_exchange_(x, center, alpha)`` moves a worker and the center toward each other::

    d = alpha * (x - center);  x -= d;  center += d

Plain torch needs four passes and a temporary; this reads and writes each element once
(the vectors are large and the arithmetic trivial, so memory traffic is the cost; how
much faster it is, by vector size: docs/studies/benchmarks.md). The CPU twin is a serial
Numba loop (every MPI rank already owns its share of the cores); the arithmetic runs in
the tensors' dtype, as torch's would.

(Synchronous EASGD's worker step, ``diff = x - center; x -= alpha diff``, stays in
torch: two passes, which a Numba loop does not beat at the sizes the solvers see
(docs/studies/benchmarks.md).)
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from .caching import CACHE
from .dispatch import BenchCase, by_device, host_array


@numba.njit(cache=CACHE)
def _exchange(x: np.ndarray, center: np.ndarray, alpha: np.floating) -> None:
    for j in range(x.shape[0]):
        d = alpha * (x[j] - center[j])
        x[j] -= d
        center[j] += d


def _check(x: torch.Tensor, center: torch.Tensor) -> None:
    for t in (x, center):
        if t.dtype != x.dtype or t.shape != x.shape or t.dim() != 1 or not t.is_contiguous():
            raise ValueError("the elastic exchange takes two contiguous 1-d tensors of one shape and dtype")


#: alpha as a numpy scalar of the tensors' dtype, so that Numba computes in that dtype.
_SCALAR = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


def _scalar(alpha: float, like: torch.Tensor) -> np.floating:
    return _SCALAR[like.dtype](alpha)


def _exchange_cpu(x: torch.Tensor, center: torch.Tensor, alpha: float) -> None:
    """``d = alpha (x - center); x -= d; center += d``, in place, in one pass."""
    _check(x, center)
    _exchange(host_array(x), host_array(center), _scalar(alpha, x))


elastic_exchange_ = by_device(_exchange_cpu, "mpisolve.kernels.elastic_cuda:elastic_exchange_")


def bench_cases(numel: int, device: str | torch.device = "cpu") -> list[BenchCase]:
    """The kernel against the same update in plain torch (its temporary preallocated)."""
    gen = torch.Generator().manual_seed(0)
    x, center = torch.randn(numel, generator=gen).to(device), torch.randn(numel, generator=gen).to(device)
    tmp = torch.empty(numel, device=device)
    alpha = 0.1

    def torch_exchange() -> None:
        torch.sub(x, center, out=tmp).mul_(alpha)
        x.sub_(tmp)
        center.add_(tmp)

    return [BenchCase("exchange", lambda: elastic_exchange_(x, center, alpha), torch_exchange)]
