"""Symmetric matrices as their upper triangles: n(n+1)/2 numbers on the wire instead of n^2."""

from __future__ import annotations

import torch


def triangle_numel(n: int) -> int:
    """Elements of the upper triangle (diagonal included) of an n x n matrix."""
    return n * (n + 1) // 2


class TrianglePacker:
    """Packs a symmetric n x n matrix into its row-major upper triangle and back.

    The index tensors are built once; ``pack`` and ``unpack`` write into buffers the
    caller owns (no allocation per call).
    """

    def __init__(self, n: int, device: torch.device | str = "cpu") -> None:
        self.n = n
        self.numel = triangle_numel(n)
        rows, cols = torch.triu_indices(n, n, device=device)
        self.upper = rows * n + cols  # flat positions of the upper triangle
        self.lower = cols * n + rows  # the same entries mirrored below the diagonal

    def pack(self, matrix: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out[:] <- upper triangle of matrix`` (``out`` has ``numel`` elements)."""
        return torch.index_select(matrix.reshape(-1), 0, self.upper, out=out)

    def unpack(self, packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out <- the symmetric matrix whose upper triangle is packed``."""
        flat = out.view(-1)
        flat.index_copy_(0, self.upper, packed)
        flat.index_copy_(0, self.lower, packed)
        return out
