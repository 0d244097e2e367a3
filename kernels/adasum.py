"""Adasum's two passes over a fused buffer: per-tensor statistics, then the scaled add.

A fused buffer holds many tensors end to end; ``bounds`` (int64, length T + 1, from 0 to
the buffer's length, non-decreasing) marks where each tensor's segment starts. For two
such buffers ``a`` and ``b`` of one layout:

- :func:`segment_stats` writes ``out[t] = (a_t . b_t, |a_t|^2, |b_t|^2)`` for every
  segment ``t``, accumulated in float64 whatever the input dtype, in one pass;
- :func:`segment_combine` reads summed statistics and writes, per segment,
  ``out_t = c_a a_t + c_b b_t`` with ``c_a = 1 - s dot / |a|^2`` and
  ``c_b = 1 - (1 - s) dot / |b|^2``, where ``s`` is ``a``'s share of the nonzero inputs
  under the pair (1/2, Adasum's own rule, for two single inputs; parallel operands then
  give their mean weighted by inputs); a coefficient whose squared norm is below
  :data:`TINY` (Horovod's guard, sqrt(DBL_MIN)) stays 1, so a zero tensor adds plainly.
  ``out`` may be ``a`` or ``b``.

How many nonzero inputs each side stands for comes per segment in ``counts`` (T x 2,
float64), coded so that the ranks of a tree can sum them: a side that is a single input
is coded 0 and counts 1 if its squared norm is at least :data:`TINY`, else 0; a side
that combines several is coded as its count plus one (:func:`side_count`).
:func:`combined_codes` gives each segment's code of the pair's result, for the pair above.

The CPU twins are serial Numba loops: mpisolve runs a rank per core, so a rank has no
idle core to parallelise over (``python -m mpisolve bench kernels`` compares them with
the plain torch equivalents, :func:`bench_cases`). The GPU twins are in
``adasum_cuda.py``.
"""

from __future__ import annotations

import sys

import numba
import numpy as np
import torch

from .caching import CACHE
from .dispatch import BenchCase, by_device, host_array

#: Squared norms below this leave their coefficient at 1 (Horovod: sqrt(DBL_MIN)).
TINY = float(np.sqrt(sys.float_info.min))

# Reassociation lets LLVM vectorise the float64 sums; no assumption about NaN or Inf.
_FAST = {"reassoc", "contract"}


@numba.njit(cache=CACHE, fastmath=_FAST)
def _segment_stats(a: np.ndarray, b: np.ndarray, bounds: np.ndarray, out: np.ndarray) -> None:
    for t in range(bounds.shape[0] - 1):
        # Loops over slices (not over a[i] for i in [lo, hi)) vectorise fully.
        sa = a[bounds[t] : bounds[t + 1]]
        sb = b[bounds[t] : bounds[t + 1]]
        dot = 0.0
        na = 0.0
        nb = 0.0
        for i in range(sa.shape[0]):
            x = np.float64(sa[i])
            y = np.float64(sb[i])
            dot += x * y
            na += x * x
            nb += y * y
        out[t, 0] = dot
        out[t, 1] = na
        out[t, 2] = nb


@numba.njit(cache=CACHE, inline="always")
def pair_coefficient(dot: float, norm_sq: float, share: float) -> float:
    """One operand's Adasum coefficient from the pair's dot product, its squared norm and its share of the inputs."""
    if norm_sq >= TINY:
        return 1.0 - share * dot / norm_sq
    return 1.0


@numba.njit(cache=CACHE, inline="always")
def side_count(code: float, norm_sq: float) -> float:
    """How many nonzero inputs a side stands for, from its code (module docstring) and its squared norm."""
    if code > 0.0:
        return code - 1.0
    return 1.0 if norm_sq >= TINY else 0.0


@numba.njit(cache=CACHE, inline="always")
def lower_share(count_a: float, count_b: float) -> float:
    """``a``'s share of a pair's nonzero inputs (1/2 where a side has none: its coefficients are then 1)."""
    if count_a > 0.0 and count_b > 0.0:
        return count_a / (count_a + count_b)
    return 0.5


@numba.njit(cache=CACHE, fastmath=_FAST)
def _segment_combine(
    a: np.ndarray, b: np.ndarray, bounds: np.ndarray, stats: np.ndarray, counts: np.ndarray, out: np.ndarray
) -> None:
    for t in range(bounds.shape[0] - 1):
        share = lower_share(side_count(counts[t, 0], stats[t, 1]), side_count(counts[t, 1], stats[t, 2]))
        # In the buffer's dtype: float32 arithmetic runs twice as wide (and vectorises
        # in place), one rounding of a float64 coefficient apart.
        ca = a.dtype.type(pair_coefficient(stats[t, 0], stats[t, 1], share))
        cb = a.dtype.type(pair_coefficient(stats[t, 0], stats[t, 2], 1.0 - share))
        sa = a[bounds[t] : bounds[t + 1]]
        sb = b[bounds[t] : bounds[t + 1]]
        so = out[bounds[t] : bounds[t + 1]]
        for i in range(sa.shape[0]):
            so[i] = ca * sa[i] + cb * sb[i]


@numba.njit(cache=CACHE)
def _combined_codes(stats: np.ndarray, counts: np.ndarray, out: np.ndarray) -> None:
    for t in range(stats.shape[0]):
        out[t] = side_count(counts[t, 0], stats[t, 1]) + side_count(counts[t, 1], stats[t, 2]) + 1.0


def _check(a: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor, stats: torch.Tensor) -> None:
    if a.shape != b.shape or a.dim() != 1 or a.dtype != b.dtype:
        raise ValueError(
            f"a and b must be flat tensors of one shape and dtype, got {a.shape} {a.dtype} and {b.shape} {b.dtype}"
        )
    if bounds.dtype != torch.int64 or bounds.dim() != 1 or bounds.numel() < 1:
        raise ValueError("bounds must be a non-empty 1-D int64 tensor")
    if stats.dtype != torch.float64 or tuple(stats.shape) != (bounds.numel() - 1, 3):
        raise ValueError(
            f"stats must be float64 of shape ({bounds.numel() - 1}, 3), got {stats.dtype} {tuple(stats.shape)}"
        )


def _check_counts(stats: torch.Tensor, counts: torch.Tensor) -> None:
    if counts.dtype != torch.float64 or tuple(counts.shape) != (stats.shape[0], 2):
        raise ValueError(
            f"counts must be float64 of shape ({stats.shape[0]}, 2), got {counts.dtype} {tuple(counts.shape)}"
        )


def _check_codes(stats: torch.Tensor, counts: torch.Tensor, out: torch.Tensor) -> None:
    _check_counts(stats, counts)
    if out.dtype != torch.float64 or tuple(out.shape) != (stats.shape[0],):
        raise ValueError(f"out must be float64 of shape ({stats.shape[0]},), got {out.dtype} {tuple(out.shape)}")


def segment_stats_cpu(a: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Per-segment (a.b, |a|^2, |b|^2) in float64 into ``out`` (T x 3); returns ``out``."""
    _check(a, b, bounds, out)
    _segment_stats(host_array(a), host_array(b), host_array(bounds), host_array(out))
    return out


def segment_combine_cpu(
    a: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor, stats: torch.Tensor, counts: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Per-segment Adasum ``c_a a + c_b b`` from summed ``stats`` and the sides' coded ``counts``
    (module docstring) into ``out``; returns ``out``."""
    _check(a, b, bounds, stats)
    _check_counts(stats, counts)
    if out.shape != a.shape or out.dtype != a.dtype:
        raise ValueError("out must have a's shape and dtype")
    _segment_combine(
        host_array(a), host_array(b), host_array(bounds), host_array(stats), host_array(counts), host_array(out)
    )
    return out


def combined_codes_cpu(stats: torch.Tensor, counts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Each segment's code (module docstring) of the pair that ``stats`` and ``counts`` describe
    combined, for every segment, into ``out`` (T); returns ``out``."""
    _check_codes(stats, counts, out)
    _combined_codes(host_array(stats), host_array(counts), host_array(out))
    return out


segment_stats = by_device(segment_stats_cpu, "mpisolve.kernels.adasum_cuda:segment_stats")
segment_combine = by_device(segment_combine_cpu, "mpisolve.kernels.adasum_cuda:segment_combine")
combined_codes = by_device(combined_codes_cpu, "mpisolve.kernels.adasum_cuda:combined_codes")


def warm_up_cpu(dtype: torch.dtype) -> None:
    """Compile (or load from Numba's cache) both CPU kernels for buffers of ``dtype`` now.

    The first call of a kernel for a dtype compiles it (or loads it from the cache), which
    takes far longer than a step's work; a reduction built ahead of training pays for that
    then, not inside its first step.
    """
    a = torch.zeros(1, dtype=dtype)
    bounds = torch.tensor([0, 1])
    stats = torch.zeros(1, 3, dtype=torch.float64)
    segment_stats_cpu(a, a, bounds, stats)
    counts = torch.zeros(1, 2, dtype=torch.float64)
    segment_combine_cpu(a, a, bounds, stats, counts, a)
    combined_codes_cpu(stats, counts, torch.zeros(1, dtype=torch.float64))


# ----------------------------------------------------------- torch equivalents
# Per-segment loops: faster than the vectorised torch forms (segment_reduce,
# repeat_interleave), which materialise float64 or per-element coefficient copies.
def torch_segment_stats(a: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The plain torch equivalent of :func:`segment_stats`: three float64 dots per segment."""
    edges = bounds.tolist()
    for t, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        x, y = a[lo:hi].double(), b[lo:hi].double()
        out[t, 0], out[t, 1], out[t, 2] = torch.dot(x, y), torch.dot(x, x), torch.dot(y, y)
    return out


def torch_segment_combine(
    a: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor, stats: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """The plain torch equivalent of :func:`segment_combine` of single inputs: one fused add per segment."""
    edges = bounds.tolist()
    for (lo, hi), (dot, na, nb) in zip(zip(edges[:-1], edges[1:]), stats.tolist()):
        ca = 1 - dot / (2 * na) if na >= TINY else 1.0
        cb = 1 - dot / (2 * nb) if nb >= TINY else 1.0
        torch.add(a[lo:hi] * ca, b[lo:hi], alpha=cb, out=out[lo:hi])
    return out


def bench_cases(numel: int, device: str | torch.device = "cpu") -> list[BenchCase]:
    """The kernels against their torch equivalents on a float32 buffer of ``numel``
    elements cut into 62 segments of uneven sizes (as resnet18's tensors are)."""
    generator = torch.Generator().manual_seed(0)
    weights = torch.rand(62, generator=generator) ** 4
    lengths = torch.floor(weights / weights.sum() * numel).to(torch.int64)
    lengths[0] += numel - int(lengths.sum())
    bounds = torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0))).to(device)
    a = torch.randn(numel, generator=generator).to(device)
    b = torch.randn(numel, generator=generator).to(device)
    stats = torch.zeros(len(lengths), 3, dtype=torch.float64, device=device)
    segment_stats(a, b, bounds, stats)
    counts = torch.zeros(len(lengths), 2, dtype=torch.float64, device=device)  # single inputs
    out = torch.empty_like(a)
    return [
        BenchCase(
            "adasum.segment_stats",
            kernel=lambda: segment_stats(a, b, bounds, stats),
            reference=lambda: torch_segment_stats(a, b, bounds, stats),
        ),
        BenchCase(
            "adasum.segment_combine",
            kernel=lambda: segment_combine(a, b, bounds, stats, counts, out),
            reference=lambda: torch_segment_combine(a, b, bounds, stats, out),
        ),
    ]
