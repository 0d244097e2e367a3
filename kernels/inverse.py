"""Batched inversion and eigendecomposition of symmetric positive semi-definite matrices.

K-FAC inverts many factors at once, several of them of one size (ResNet-18 has four
2304 x 2304 factors). Stacking equal sizes into one ``[B, n, n]`` tensor and making one
batched LAPACK/cuSOLVER call per size saves the per-call overhead that dominates small
matrices. Both kernels work in place on the stack (scratch the caller filled) and return
one status per matrix; neither raises on bad numbers:

- ``OK``: the fast path worked (batched Cholesky, or batched eigh in the stack's dtype);
- ``RECOVERED``: the fast path failed for this matrix (not positive definite in working
  precision, eigh did not converge) and a float64 eigh gave the result instead;
- ``FAILED``: the matrix is not finite, or even float64 eigh failed: the identity is
  left in its place and the caller chooses the fallback (mpisolve's K-FAC keeps the
  previous inverse).

The CPU twin is LAPACK through torch: ``cholesky_ex`` reports failures per matrix, so
one bad factor does not send the whole batch to the slow path (a Numba kernel would only
re-implement potrf). The GPU twin (``inverse_cuda``) runs the same algorithm, written
once here against a small :class:`LinalgBackend`, on CuPy's batched cuSOLVER routines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from .dispatch import BenchCase, by_device

OK, RECOVERED, FAILED = 0, 1, 2


class LinalgBackend(Protocol):
    """The batched routines the algorithm needs, on torch tensors of one device."""

    def cholesky(self, stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Lower Cholesky factors ``[B, n, n]`` and a bool mask (CPU) of the matrices that had one."""

    def cholesky_inverse(self, factors: torch.Tensor, out: torch.Tensor) -> None:
        """``out[i] <- (L_i L_i^T)^-1`` from Cholesky factors."""

    def eigh(self, stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Eigenvalues ``[B, n]`` and eigenvectors ``[B, n, n]``; raises if it fails."""


class TorchLinalg:
    """LAPACK (CPU) through torch."""

    def cholesky(self, stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        factors, info = torch.linalg.cholesky_ex(stack)
        return factors, (info == 0).cpu()

    def cholesky_inverse(self, factors: torch.Tensor, out: torch.Tensor) -> None:
        torch.cholesky_inverse(factors, out=out)

    def eigh(self, stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.linalg.eigh(stack)


#: What a failed LAPACK/cuSOLVER call raises: torch's LinAlgError is a RuntimeError,
#: numpy's and CuPy's a ValueError.
LINALG_ERRORS = (RuntimeError, ValueError)


def _finite(stack: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(stack).flatten(1).all(dim=1).cpu()


def _set_identity(matrix: torch.Tensor) -> None:
    matrix.zero_()
    matrix.diagonal().fill_(1.0)


def _eigh64(matrix: torch.Tensor, backend: LinalgBackend) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Float64 eigendecomposition of one matrix, or None if it fails or is not finite."""
    try:
        values, vectors = backend.eigh(matrix.to(torch.float64).unsqueeze(0))
    except LINALG_ERRORS:
        return None
    if not (bool(torch.isfinite(values).all()) and bool(torch.isfinite(vectors).all())):
        return None
    return values[0], vectors[0]


def _inverse_by_eigh(damped: torch.Tensor, shift: float, backend: LinalgBackend) -> torch.Tensor | None:
    """``damped^-1`` through a float64 eigh, or None if that fails or there is no inverse.

    ``damped`` holds factor + shift I with a positive semi-definite factor, so eigenvalues
    below ``shift`` are round-off and are raised to ``shift``. Without a shift, a matrix
    singular to float64 precision has no inverse (None).
    """
    decomposition = _eigh64(damped, backend)
    if decomposition is None:
        return None
    values, vectors = decomposition
    if shift <= 0:
        top = float(values.abs().max())
        if not float(values.min()) > top * damped.shape[-1] * torch.finfo(torch.float64).eps:
            return None
    inverse = (vectors / values.clamp(min=shift)) @ vectors.T
    return inverse if bool(torch.isfinite(inverse).all()) else None


def invert_spd(stack: torch.Tensor, shifts: Sequence[float], backend: LinalgBackend) -> torch.Tensor:
    """In place ``stack[i] <- (stack[i] + shifts[i] I)^-1``; the status of each matrix (CPU int32)."""
    if stack.dim() != 3 or stack.shape[1] != stack.shape[2] or len(shifts) != stack.shape[0]:
        raise ValueError(f"need a [B, n, n] stack and B shifts, got {tuple(stack.shape)} and {len(shifts)}")
    status = torch.full((stack.shape[0],), OK, dtype=torch.int32)
    finite = _finite(stack)
    for i in torch.nonzero(~finite).flatten().tolist():
        _set_identity(stack[i])  # keeps the batched call clean; reported FAILED below
        status[i] = FAILED
    stack.diagonal(dim1=-2, dim2=-1).add_(torch.tensor(shifts, dtype=stack.dtype, device=stack.device)[:, None])
    factors, ok = backend.cholesky(stack)
    # The stack still holds the damped matrices: invert the rejected ones by eigh first.
    rescued = {}
    for i in torch.nonzero(~ok).flatten().tolist():
        if finite[i]:
            rescued[i] = _inverse_by_eigh(stack[i], float(shifts[i]), backend)
            status[i] = FAILED if rescued[i] is None else RECOVERED
        _set_identity(factors[i])  # a harmless factor for the batched inverse
    backend.cholesky_inverse(factors, out=stack)
    for i, inverse in rescued.items():
        if inverse is not None:
            stack[i].copy_(inverse)
    status[~_finite(stack)] = FAILED  # overflow in the inverse itself
    for i in torch.nonzero(status == FAILED).flatten().tolist():
        _set_identity(stack[i])
    return status


def eigh_psd(stack: torch.Tensor, values: torch.Tensor, backend: LinalgBackend) -> torch.Tensor:
    """In place ``stack[i] <- Q_i`` with ``values[i] <- d_i >= 0``: ``stack[i] = Q_i diag(d_i) Q_i^T``.

    Eigenvalues are clamped at 0 (the factors are positive semi-definite; anything
    below is round-off). Returns the status of each matrix (CPU int32); a FAILED matrix
    gets the identity (Q = I, d = 1).
    """
    if stack.dim() != 3 or stack.shape[1] != stack.shape[2] or tuple(values.shape) != tuple(stack.shape[:2]):
        raise ValueError(
            f"need a [B, n, n] stack and [B, n] values, got {tuple(stack.shape)} and {tuple(values.shape)}"
        )
    status = torch.full((stack.shape[0],), OK, dtype=torch.int32)
    finite = _finite(stack)
    try:
        if not bool(finite.all()):
            raise ValueError("not finite")  # take the one-by-one path
        d, q = backend.eigh(stack)
        good = _finite(q) & torch.isfinite(d).all(dim=1).cpu()
        stack.copy_(q)
        values.copy_(d)
        redo = torch.nonzero(~good).flatten().tolist()
    except LINALG_ERRORS:
        redo = list(range(stack.shape[0]))
    for i in redo:
        if not finite[i]:
            result = None
        else:
            result = _eigh_one(stack[i], backend)
        if result is None:
            _set_identity(stack[i])
            values[i].fill_(1.0)
            status[i] = FAILED
        else:
            (d, q), recovered = result
            stack[i].copy_(q)
            values[i].copy_(d)
            status[i] = RECOVERED if recovered else OK
    values.clamp_(min=0.0)
    return status


def _eigh_one(matrix: torch.Tensor, backend: LinalgBackend) -> tuple[tuple[torch.Tensor, torch.Tensor], bool] | None:
    """One matrix: eigh in its own dtype, else in float64 (recovered); None if both fail."""
    try:
        d, q = backend.eigh(matrix.unsqueeze(0))
        if bool(torch.isfinite(d).all()) and bool(torch.isfinite(q).all()):
            return (d[0], q[0]), False
    except LINALG_ERRORS:
        pass
    decomposition = _eigh64(matrix, backend)
    return None if decomposition is None else (decomposition, True)


_TORCH = TorchLinalg()


def _inverse_spd_cpu(stack: torch.Tensor, shifts: Sequence[float]) -> torch.Tensor:
    return invert_spd(stack, shifts, _TORCH)


def _eigh_psd_cpu(stack: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return eigh_psd(stack, values, _TORCH)


_inverse_spd_cpu.__doc__ = invert_spd.__doc__
_eigh_psd_cpu.__doc__ = eigh_psd.__doc__

#: ``inverse_spd_(stack, shifts) -> status``: see :func:`invert_spd`.
inverse_spd_ = by_device(_inverse_spd_cpu, "mpisolve.kernels.inverse_cuda:inverse_spd_")
#: ``eigh_psd_(stack, values) -> status``: see :func:`eigh_psd`.
eigh_psd_ = by_device(_eigh_psd_cpu, "mpisolve.kernels.inverse_cuda:eigh_psd_")


def bench_cases(numel: int, device: str | torch.device = "cpu") -> list[BenchCase]:
    """One batched call against a loop of per-matrix calls, for a few matrix sizes.

    Each size stacks as many matrices as fit in ``numel`` elements (at least 2); both
    sides copy the same prepared matrices in first, as the solver does.
    """
    cases = []
    generator = torch.Generator().manual_seed(0)
    for n in (16, 64, 256):
        batch = max(2, numel // (n * n))
        x = torch.randn(batch, n, 2 * n, generator=generator)
        source = (x @ x.transpose(1, 2) / (2 * n)).to(device)
        stack = torch.empty_like(source)
        values = torch.empty(batch, n, device=device)
        shifts = [1e-3] * batch

        def batched_inverse(
            source: torch.Tensor = source, stack: torch.Tensor = stack, shifts: list[float] = shifts
        ) -> None:
            stack.copy_(source)
            inverse_spd_(stack, shifts)

        def looped_inverse(source: torch.Tensor = source, stack: torch.Tensor = stack) -> None:
            stack.copy_(source)
            for matrix in stack:
                matrix.diagonal().add_(1e-3)
                factor, _ = torch.linalg.cholesky_ex(matrix)
                torch.cholesky_inverse(factor, out=matrix)

        def batched_eigh(
            source: torch.Tensor = source, stack: torch.Tensor = stack, values: torch.Tensor = values
        ) -> None:
            stack.copy_(source)
            eigh_psd_(stack, values)

        def looped_eigh(
            source: torch.Tensor = source, stack: torch.Tensor = stack, values: torch.Tensor = values
        ) -> None:
            stack.copy_(source)
            for matrix, d in zip(stack, values):
                d_i, q_i = torch.linalg.eigh(matrix)
                matrix.copy_(q_i)
                d.copy_(d_i)

        cases.append(BenchCase(f"inverse_spd {batch}x{n}x{n}", batched_inverse, looped_inverse))
        cases.append(BenchCase(f"eigh_psd {batch}x{n}x{n}", batched_eigh, looped_eigh))
    return cases
