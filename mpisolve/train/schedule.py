"""When a training run logs, evaluates, checkpoints and stops: the same moments on every rank.

Progress is counted in applied updates ("steps") and the global samples they covered
(an epoch is as many global samples as the training set has), never in micro-batches:
under ABS-SGD and asynchronous solvers ranks compute different numbers of micro-batches.

Every rank must take these decisions at the same point of its sequence of collectives,
or a rank would wait forever in an evaluation the others never join. Two counters give
every rank the same sequence of :class:`Progress` values:

- :class:`LockstepCounter`, for solvers with ``lockstep = True``: every rank's ``step``
  returns the same applied updates with the same ``global_samples``, so each rank counts
  them itself, with no communication at all;
- :class:`AgreedCounter`, for asynchronous solvers: each rank counts its own updates and
  a nonblocking allreduce, kept in flight while training goes on, sums them; each
  completed round is a progress value every rank sees (at its own time, in the same
  order).

:class:`Schedule` then turns two successive progress values into what is due.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..comm.communicator import Communicator
from ..comm.reusable import reusable_allreduce
from ..solvers.base import StepInfo


@dataclass(frozen=True)
class Progress:
    """Applied updates and the global samples they covered, as every rank agrees on them."""

    steps: int = 0
    samples: int = 0


@dataclass(frozen=True)
class Due:
    stop: bool
    evaluate: bool
    log: bool
    checkpoint: bool


def _crossed(before: float, now: float, every: float) -> bool:
    return math.floor(now / every) > math.floor(before / every)


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Stop after ``epochs`` (of ``train_size`` global samples) or ``steps``; log, evaluate, checkpoint periodically."""

    train_size: int
    epochs: float | None
    steps: int | None
    eval_every: float
    log_every: int
    checkpoint_every: int | None
    checkpoints: bool

    def due(self, before: Progress, now: Progress) -> Due:
        stop = self.fraction(now) >= 1.0
        evaluate = stop or _crossed(before.samples, now.samples, self.eval_every * self.train_size)
        checkpoint = self.checkpoints and (
            stop or (self.checkpoint_every is not None and _crossed(before.steps, now.steps, self.checkpoint_every))
        )
        log = stop or evaluate or _crossed(before.steps, now.steps, self.log_every)
        return Due(stop=stop, evaluate=evaluate, log=log, checkpoint=checkpoint)

    def fraction(self, now: Progress) -> float:
        """How much of the run is done (1.0 when it must stop)."""
        if self.steps is not None:
            return now.steps / self.steps
        assert self.epochs is not None
        return now.samples / (self.epochs * self.train_size)

    def epoch(self, now: Progress) -> float:
        return now.samples / self.train_size


class LockstepCounter:
    """Counts this rank's applied updates: the same on every rank for a lockstep solver."""

    def __init__(self) -> None:
        self.now = Progress()

    def start(self) -> None:
        """Nothing to start: no communication is needed."""

    def advance(self, info: StepInfo) -> Progress | None:
        """The new progress after an applied update, else None."""
        if not info.applied:
            return None
        self.now = Progress(self.now.steps + 1, self.now.samples + info.global_samples)
        return self.now

    def close(self) -> None:
        """Nothing in flight."""

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.now.steps, "samples": self.now.samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.now = Progress(int(state["steps"]), int(state["samples"]))


class AgreedCounter:
    """Sums every rank's applied updates with a nonblocking allreduce kept in flight.

    One round is in flight at a time; it carries this rank's running totals when it is
    posted. When it completes, its sums are the new progress (the same values on every
    rank, since every rank joins every round) and the next round is posted at once.
    """

    def __init__(self, comm: Communicator) -> None:
        self.now = Progress()
        self.comm = comm
        self._mine = [0, 0]  # this rank's applied updates and their samples
        self._buffer = torch.zeros(2, dtype=torch.float64)
        self._round = reusable_allreduce(comm, self._buffer, "sum")  # tested in passing: never node-shared
        self._in_flight = False
        self._posted_at = 0.0

    def start(self) -> None:
        self._post()

    def _post(self) -> None:
        self._buffer[0], self._buffer[1] = self._mine
        self._round.start()
        self._in_flight = True
        self._posted_at = time.monotonic()

    def advance(self, info: StepInfo) -> Progress | None:
        """Count ``info``; the summed progress if a round just completed, else None.

        A round that stays in flight longer than the communicator's watchdog timeout
        (a rank stopped taking part) raises ``CommTimeout``, as a blocking wait would.
        """
        if info.applied:
            self._mine[0] += 1
            self._mine[1] += info.global_samples
        if not self._round.test():
            if time.monotonic() - self._posted_at > self.comm.timeout_s:
                raise self.comm.timed_out("progress allreduce (a rank stopped training)")
            return None
        self._round.wait("progress allreduce")  # completed: brings a staged result into the buffer
        self.now = Progress(int(self._buffer[0]), int(self._buffer[1]))
        self._post()
        return self.now

    def close(self) -> None:
        """Complete the round in flight (every rank posted it) and free it."""
        if self._in_flight:
            self._round.wait("progress allreduce")
            self._in_flight = False
        self._round.free()

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.now.steps, "samples": self.now.samples, "mine": list(self._mine)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.now = Progress(int(state["steps"]), int(state["samples"]))
        self._mine = [int(v) for v in state["mine"]]
