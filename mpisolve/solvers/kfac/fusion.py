"""SPD-KFAC's dynamic tensor fusion: a communication model fitted at run time and the merge plan.

Factors become ready one by one (A during forward, G during backward). Sending each
alone pays the start-up latency ``alpha`` every time; fusing all of them waits for the
last. With a linear model ``t(size) = alpha + beta * size`` of one collective, fitted from
collectives timed on this machine, and the measured times at which each factor becomes
ready, :func:`plan_fusion` merges a factor into the next one's message exactly when that
does not delay anything: when the message could not have started before the next factor
is ready anyway (the channel is busy), or when waiting for the next factor costs less
than a start-up latency.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...comm.communicator import Communicator


@dataclass(frozen=True)
class CommModel:
    """Seconds of one collective of ``size`` elements: ``alpha + beta * size``."""

    alpha: float
    beta: float

    def seconds(self, size: int) -> float:
        return self.alpha + self.beta * size


def fit_comm_model(sizes: Sequence[int], seconds: Sequence[float]) -> CommModel:
    """Least-squares line through (size, seconds), with alpha and beta kept >= 0."""
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError("fitting a communication model needs at least two (size, seconds) points")
    x = np.asarray(sizes, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    design = np.stack([np.ones_like(x), x], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, y, rcond=None)
    if beta < 0:  # flat (or noisy) timings: latency only
        return CommModel(alpha=float(max(y.mean(), 0.0)), beta=0.0)
    if alpha < 0:  # a line through the origin
        return CommModel(alpha=0.0, beta=float((x @ y) / (x @ x)))
    return CommModel(alpha=float(alpha), beta=float(beta))


def probe_sizes(largest: int, points: int = 6, smallest: int = 256) -> list[int]:
    """Geometrically spaced message sizes from ``smallest`` to ``largest`` elements."""
    largest = max(largest, smallest * 4)
    return sorted({int(round(v)) for v in np.geomspace(smallest, largest, points)})


def measure_comm_model(
    comm: Communicator, kind: str, sizes: Sequence[int], *, repeats: int = 3, dtype: torch.dtype = torch.float32
) -> CommModel:
    """Time ``kind`` ("allreduce" or "bcast") collectives of ``sizes`` elements and fit a model.

    Each timing is the slowest rank's (what a collective costs), the median over
    ``repeats``; every rank gets the same numbers and so the same model.
    """
    if kind not in ("allreduce", "bcast"):
        raise ValueError(f"kind must be 'allreduce' or 'bcast', got {kind!r}")
    buffer = torch.zeros(max(sizes), dtype=dtype)
    medians = []
    for size in sizes:
        view = buffer[:size]
        times = []
        for _ in range(repeats):
            comm.barrier()
            start = time.perf_counter()
            if kind == "allreduce":
                comm.allreduce_(view, what="communication model probe")
            else:
                comm.bcast_(view, root=0, what="communication model probe")
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    slowest = comm.allreduce_(torch.tensor(medians, dtype=torch.float64), op="max", what="communication model")
    return fit_comm_model(sizes, slowest.tolist())


def plan_fusion(sizes: Sequence[int], ready: Sequence[float], model: CommModel) -> list[list[int]]:
    """Contiguous groups of positions ``0..L-1`` (factors in the order they become ready).

    ``sizes[l]``: elements of factor l's message; ``ready[l]``: when it is ready (seconds
    from any common origin, non-decreasing). One channel carries the messages one after
    another. The open group closes before factor l+1 unless l+1 is ready before the
    group's message would end and either the message could not start before l+1 is ready
    (the channel is still busy) or waiting for l+1 costs less than a start-up ``alpha``.
    """
    if len(sizes) != len(ready):
        raise ValueError("plan_fusion needs one ready time per size")
    if not sizes:
        return []
    groups: list[list[int]] = []
    group, group_size = [0], sizes[0]
    channel_free = 0.0
    for nxt in range(1, len(sizes)):
        start = max(channel_free, ready[group[-1]])
        end = start + model.seconds(group_size)
        merge = ready[nxt] < end and (start >= ready[nxt] or ready[nxt] - start < model.alpha)
        if merge:
            group.append(nxt)
            group_size += sizes[nxt]
            continue
        groups.append(group)
        channel_free = end
        group, group_size = [nxt], sizes[nxt]
    groups.append(group)
    return groups
