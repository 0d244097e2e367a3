"""GPU twin of ``inverse``: the same algorithm on CuPy's batched cuSOLVER routines.

Imported only when a CUDA tensor reaches :func:`mpisolve.kernels.inverse.inverse_spd_`
or ``eigh_psd_``; CuPy itself is imported on first use, so this module imports (and its
backend can be exercised with numpy standing in for CuPy) on machines without a GPU.
CuPy views the torch tensors' memory through ``__cuda_array_interface__``; nothing is
copied to the host. CuPy runs on torch's current stream of the tensors' device, so its
work is ordered after whatever produced the stack and before whatever reads it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .inverse import LINALG_ERRORS, eigh_psd, invert_spd


class XpLinalg:
    """The :class:`~mpisolve.kernels.inverse.LinalgBackend` on an array module ``xp``.

    ``xp`` is CuPy on a GPU (numpy in the tests); ``errstate`` makes failed factorizations
    raise (CuPy otherwise returns garbage without a word).
    """

    def __init__(
        self, xp: Any, errstate: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    ) -> None:
        self.xp = xp
        self.errstate = errstate

    def _tensor(self, array: Any, like: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(array, device=like.device)

    def cholesky(self, stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xp = self.xp
        a = xp.asarray(stack)
        ok = torch.ones(stack.shape[0], dtype=torch.bool)
        try:
            with self.errstate():
                factors = xp.linalg.cholesky(a)
        except LINALG_ERRORS:
            # The batched call names no culprit: factor one by one, identity for the rejected.
            factors = xp.empty_like(a)
            for i in range(a.shape[0]):
                try:
                    with self.errstate():
                        factors[i] = xp.linalg.cholesky(a[i])
                except LINALG_ERRORS:
                    factors[i] = xp.eye(a.shape[-1], dtype=a.dtype)
                    ok[i] = False
        return self._tensor(factors, stack), ok

    def cholesky_inverse(self, factors: torch.Tensor, out: torch.Tensor) -> None:
        xp = self.xp
        with self.errstate():
            lower_inverse = xp.linalg.inv(xp.asarray(factors))
        out.copy_(self._tensor(xp.matmul(xp.swapaxes(lower_inverse, -1, -2), lower_inverse), out))

    def eigh(self, stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with self.errstate():
            values, vectors = self.xp.linalg.eigh(self.xp.asarray(stack))
        return self._tensor(values, stack), self._tensor(vectors, stack)


@functools.cache
def _cupy_backend() -> XpLinalg:
    import cupy
    import cupyx

    return XpLinalg(cupy, lambda: cupyx.errstate(linalg="raise"))


@contextlib.contextmanager
def _on_torch_stream(tensor: torch.Tensor) -> Iterator[None]:
    """CuPy's current device and stream set to torch's current ones for ``tensor``."""
    import cupy

    with (
        cupy.cuda.Device(tensor.device.index),
        cupy.cuda.ExternalStream(torch.cuda.current_stream(tensor.device).cuda_stream),
    ):
        yield


def inverse_spd_(stack: torch.Tensor, shifts: Sequence[float]) -> torch.Tensor:
    with _on_torch_stream(stack):
        return invert_spd(stack, shifts, _cupy_backend())


def eigh_psd_(stack: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    with _on_torch_stream(stack):
        return eigh_psd(stack, values, _cupy_backend())
