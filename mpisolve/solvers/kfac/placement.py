"""Which rank inverts which factor.

``EVERY_RANK`` marks a factor every rank inverts itself (no broadcast). Everything here
is deterministic in its inputs, so ranks given the same numbers agree without talking.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Owner of a factor that every rank inverts redundantly.
EVERY_RANK = -1


def balanced(costs: Sequence[float], ranks: int, replicated: Sequence[bool] | None = None) -> list[int]:
    """Largest cost first, each to the least loaded rank (lowest rank on ties).

    Greedy longest-processing-time scheduling: its makespan is within 4/3 of the best.
    Factors marked ``replicated`` get ``EVERY_RANK`` and add to no single rank's load.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    replicated = replicated if replicated is not None else [False] * len(costs)
    owners = [EVERY_RANK] * len(costs)
    loads = [0.0] * ranks
    for f in sorted(range(len(costs)), key=lambda f: (-costs[f], f)):
        if replicated[f]:
            continue
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        owners[f] = rank
        loads[rank] += costs[f]
    return owners


def round_robin(count: int, ranks: int) -> list[int]:
    """Factor f to rank f mod ranks, in layer order (MPD-KFAC's placement)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    return [f % ranks for f in range(count)]


def loads(costs: Sequence[float], owners: Sequence[int], ranks: int) -> list[float]:
    """Each rank's inversion cost: what it owns plus every replicated factor."""
    shared = sum(c for c, o in zip(costs, owners) if o == EVERY_RANK)
    per_rank = [shared] * ranks
    for c, o in zip(costs, owners):
        if o != EVERY_RANK:
            per_rank[o] += c
    return per_rank


def max_over_mean(values: Sequence[float]) -> float:
    """Imbalance of a load vector: 1.0 is perfect."""
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def flop_cost(n: int) -> float:
    """Relative cost of inverting an n x n matrix (Cholesky and inverse, or eigh: O(n^3))."""
    return float(n) ** 3
