"""Symmetric matrices as their upper triangles: n(n+1)/2 numbers instead of n^2.

K-FAC factors and inverses are symmetric; SPD-KFAC sends and stores them as the
row-major upper triangle (diagonal included). Packing is a gather of contiguous row
pieces; unpacking also writes the mirror image below the diagonal, a transposed write
that, done element by element (``index_copy_``), runs far below memory speed on a CPU.
The CPU twin walks the matrix in square tiles so both writes stay in cache. It runs on
the calling thread: under MPI each rank has its own core(s), and a Numba OpenMP pool
beside torch's spins on the cores other ranks compute on (what that costs SPD-KFAC's
factor phase when ranks share cores: docs/studies/kfac-bench.md). The GPU twin (``triangle_cuda``) gives one thread
per matrix entry.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from .caching import CACHE
from .dispatch import BenchCase, by_device, host_array

#: Tile edge for the CPU unpack: the best of 8..256 for n = 4608 (docs/studies/kfac-bench.md).
TILE = 16


def triangle_numel(n: int) -> int:
    """Elements of the upper triangle (diagonal included) of an n x n matrix."""
    return n * (n + 1) // 2


def _check(matrix: torch.Tensor, packed: torch.Tensor) -> None:
    n = matrix.shape[0]
    if matrix.dim() != 2 or matrix.shape[1] != n or not matrix.is_contiguous():
        raise ValueError(f"need a contiguous square matrix, got shape {tuple(matrix.shape)}")
    if packed.dim() != 1 or packed.numel() != triangle_numel(n) or not packed.is_contiguous():
        raise ValueError(f"need a contiguous vector of {triangle_numel(n)} elements, got shape {tuple(packed.shape)}")
    if matrix.dtype != packed.dtype:
        raise ValueError(f"matrix and packed triangle differ in dtype: {matrix.dtype} and {packed.dtype}")


@njit(cache=CACHE)
def _pack_rows(matrix: np.ndarray, out: np.ndarray) -> None:
    n = matrix.shape[0]
    for i in range(n):
        start = i * n - (i * (i - 1)) // 2 - i  # packed index of (i, j) is start + j
        for j in range(i, n):
            out[start + j] = matrix[i, j]


@njit(cache=CACHE)
def _unpack_tiles(packed: np.ndarray, out: np.ndarray, tile: int) -> None:
    n = out.shape[0]
    tiles = (n + tile - 1) // tile
    for ti in range(tiles):
        i0, i1 = ti * tile, min(n, ti * tile + tile)
        for tj in range(ti, tiles):
            j0, j1 = tj * tile, min(n, tj * tile + tile)
            for i in range(i0, i1):
                start = i * n - (i * (i - 1)) // 2 - i
                for j in range(max(i, j0), j1):
                    value = packed[start + j]
                    out[i, j] = value
                    out[j, i] = value


def _pack_cpu(matrix: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out <- the row-major upper triangle of matrix``; returns ``out``."""
    _check(matrix, out)
    _pack_rows(host_array(matrix), host_array(out))
    return out


def _unpack_cpu(packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out <- the symmetric matrix whose upper triangle is packed``; returns ``out``."""
    _check(out, packed)
    _unpack_tiles(host_array(packed), host_array(out), TILE)
    return out


#: ``pack_triu(matrix, out) -> out``: the row-major upper triangle (diagonal included).
pack_triu = by_device(_pack_cpu, "mpisolve.kernels.triangle_cuda:pack_triu")
#: ``unpack_triu_(packed, out) -> out``: the full symmetric matrix, both triangles written.
unpack_triu_ = by_device(_unpack_cpu, "mpisolve.kernels.triangle_cuda:unpack_triu_")


def bench_cases(numel: int, device: str | torch.device = "cpu") -> list[BenchCase]:
    """Packing and unpacking an n x n matrix of about ``numel`` elements against torch's
    index-based gather and scatter (``index_select``, two ``index_copy_``)."""
    n = max(2, int(numel**0.5))
    x = torch.randn(n, n)
    matrix = (x + x.T).to(device)
    packed = torch.empty(triangle_numel(n), device=device)
    out = torch.empty(n, n, device=device)
    rows, cols = torch.triu_indices(n, n, device=device)
    upper, lower = rows * n + cols, cols * n + rows

    def reference_pack() -> None:
        torch.index_select(matrix.view(-1), 0, upper, out=packed)

    def reference_unpack() -> None:
        out.view(-1).index_copy_(0, upper, packed)
        out.view(-1).index_copy_(0, lower, packed)

    return [
        BenchCase(f"pack_triu {n}x{n}", lambda: pack_triu(matrix, packed), reference_pack),
        BenchCase(f"unpack_triu_ {n}x{n}", lambda: unpack_triu_(packed, out), reference_unpack),
    ]
