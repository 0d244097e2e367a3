"""Where each rank's training time goes: busy, communicating, idle.

Definitions, per rank r over an interval of its training wall time W_r (evaluation and
checkpoint writing are paused out of it):

- blocked B_r: the time rank r spent waiting in MPI (``Communicator.blocked_s``: every
  wait on the world communicator and on communicators split from it);
- busy = W_r - B_r: computing (forward, backward, the emulated slowdown), the
  optimizer step, data loading, and starting communication;
- comm = min over ranks of B: the part of waiting that even the rank that waited least
  could not avoid, taken as the cost of communication itself;
- idle = B_r - comm: waiting for other ranks beyond that (load imbalance, stragglers).

The three fractions of W_r sum to 1 on every rank. A fast rank in a heterogeneous
cluster under synchronous SGD shows high idle; the slowest rank shows the comm cost.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ..comm.communicator import Communicator


class TimeAccount:
    """This rank's training wall time and time blocked in MPI, with pauses left out.

    ``wall_s`` and ``blocked_s`` start from the given offsets (a resumed run continues
    its clocks).
    """

    def __init__(self, comm: Communicator, *, wall_s: float = 0.0, blocked_s: float = 0.0) -> None:
        self.comm = comm
        self._start = time.perf_counter() - wall_s
        self._blocked_start = comm.blocked_s - blocked_s
        self._paused = 0.0
        self._paused_blocked = 0.0

    def wall_s(self) -> float:
        return time.perf_counter() - self._start - self._paused

    def blocked_s(self) -> float:
        return self.comm.blocked_s - self._blocked_start - self._paused_blocked

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the time spent in this block (and its MPI waits) out of both clocks."""
        start, blocked = time.perf_counter(), self.comm.blocked_s
        try:
            yield
        finally:
            self._paused += time.perf_counter() - start
            self._paused_blocked += self.comm.blocked_s - blocked


def split_time(walls: Sequence[float], blocked: Sequence[float]) -> tuple[list[float], list[float], list[float]]:
    """Per-rank (busy, comm, idle) fractions of each rank's wall time, as the module defines them."""
    comm_s = max(0.0, min(blocked))
    busy, comm, idle = [], [], []
    for w, b in zip(walls, blocked):
        w = max(w, 1e-12)
        b = min(max(b, 0.0), w)
        shared = min(comm_s, b)
        busy.append((w - b) / w)
        comm.append(shared / w)
        idle.append((b - shared) / w)
    return busy, comm, idle
