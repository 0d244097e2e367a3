"""LB-BSP style synchronous SGD: static micro-batch sizes proportional to each rank's speed.

Synchronous SGD on a heterogeneous cluster waits every step for its slowest worker.
Load-balanced BSP (Chen et al., SoCC'20) sizes each worker's batch by its speed so that
all finish a step together: here once, before training, from speeds given per rank or
measured with the training loop's probe. The global batch stays that of synchronous SGD
(ranks x the configured batch); the update is the sample-weighted mean of the ranks'
gradients, reduced while backward runs as the ``allreduce`` solver does.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.amp import GradScaler

from ..comm.buckets import GradientBuckets
from ..comm.communicator import Communicator
from ..errors import OptionError
from ..options import BucketOptions, MeasureOptions, option, require
from .base import BucketSolver, StepInfo, SynchronousOptions, collective_round, register


def parse_speeds(text: str) -> tuple[float, ...]:
    """``"1,1,1,0.25"`` -> relative speeds (finite, > 0)."""
    speeds = []
    for item in text.split(","):
        try:
            speed = float(item)
        except ValueError:
            raise OptionError(f"speeds must be 'measure' or comma-separated numbers, got {text!r}") from None
        require(math.isfinite(speed) and speed > 0, f"every speed must be finite and > 0, got {item.strip()!r}")
        speeds.append(speed)
    return tuple(speeds)


def proportional_batches(speeds: tuple[float, ...], total: int) -> list[int]:
    """``total`` samples split by ``speeds`` so that the slowest rank's step is as short as it can be.

    Every rank gets one sample, then each further sample goes to the rank that would
    finish it soonest. This minimises the step's time,
    ``max(batch / speed)``; rounding shares of the spare samples does not (with speeds
    1, 1, 1, 0.25 and 16 samples it gives 5, 5, 4, 2: a step of 2 / 0.25 = 8 units, not 5).
    The greedy part starts from one sample under each rank's share of the spare ones,
    which it would have given anyway, so it places about one sample per rank, not the
    whole batch (ABS-SGD splits again every round).
    """
    if total < len(speeds):
        raise OptionError(f"a global batch of {total} cannot give each of {len(speeds)} ranks a sample")
    require(all(math.isfinite(s) and s > 0 for s in speeds), f"every speed must be finite and > 0, got {speeds}")
    # The last spare sample ends at time >= spare / sum(speeds): every k / speed below that is taken.
    per_speed = (total - len(speeds)) / sum(speeds)
    batches = [max(1, math.floor(per_speed * speed) - 1) for speed in speeds]
    finish = [((batch + 1) / speed, rank) for rank, (batch, speed) in enumerate(zip(batches, speeds))]
    heapq.heapify(finish)  # when each rank's next sample would end
    for _ in range(total - sum(batches)):
        _, rank = heapq.heappop(finish)
        batches[rank] += 1
        heapq.heappush(finish, ((batches[rank] + 1) / speeds[rank], rank))
    return batches


def measure_speeds(
    comm: Communicator, configured: int, probe: Callable[[int], float] | None, batches: int, *, who: str
) -> tuple[float, ...]:
    """Collective: every rank's speed in samples/s, from ``probe`` (a warm-up, then the median of ``batches``)."""
    if probe is None:
        raise OptionError(f"{who} measures each rank's speed with the training loop's probe, and none was given")
    probe(configured)
    seconds = statistics.median(probe(configured) for _ in range(batches))
    return tuple(comm.allgather_object(configured / max(seconds, 1e-9)))


@dataclass(frozen=True, kw_only=True)
class LBBSPOptions(MeasureOptions, BucketOptions, SynchronousOptions):
    """How the ranks' speeds are known, and the gradient buckets."""

    speeds: str = option(
        "measure",
        "measure: time micro-batches with the loop's probe (after one warm-up, the median); "
        "or relative speeds, one per rank (1,1,1,0.25)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.speeds != "measure":
            parse_speeds(self.speeds)


@register
class LBBSP(BucketSolver[LBBSPOptions]):
    """Synchronous SGD with static speed-proportional micro-batches and sample-weighted averaging."""

    name = "lb-bsp"
    Options = LBBSPOptions

    def setup(self) -> None:
        if self.options.speeds != "measure":
            given = parse_speeds(self.options.speeds)
            require(
                len(given) == self.comm.size,
                f"speeds gives {len(given)} speeds for {self.comm.size} ranks (give one per rank, or 'measure')",
            )
        self.grads = GradientBuckets(
            self.params,
            self.comm,
            bucket_bytes=int(self.options.bucket_mb * 1e6),
            samples=self.samples_seen,
            weighted=True,
        )
        #: Every rank's speed (samples/s, or as given) and micro-batch size, once decided.
        self.speeds: tuple[float, ...] | None = None
        self.batch_sizes: list[int] | None = None

    def local_batch_size(self, configured: int, probe: Callable[[int], float] | None = None) -> int:
        """Collective: this rank's share of ``ranks * configured`` samples, by speed (decided once)."""
        if self.batch_sizes is None:
            if self.options.speeds == "measure":
                who = "lb-bsp with speeds='measure' (or give speeds='1,1,...')"
                self.speeds = measure_speeds(self.comm, configured, probe, self.options.measure_batches, who=who)
            else:
                self.speeds = parse_speeds(self.options.speeds)
            self.batch_sizes = proportional_batches(self.speeds, configured * self.comm.size)
        return self.batch_sizes[self.comm.rank]

    @collective_round
    def step(self, batch_size: int | None = None, *, scaler: GradScaler | None = None) -> StepInfo:
        """Complete the weighted reduction and step. The sample counts are the forward passes'."""
        if batch_size is not None:
            raise ValueError(
                "lb-bsp weights each rank's gradients by the samples its forward passes saw, "
                "while backward runs: step(batch_size=...) cannot change them afterwards"
            )
        return self._bucket_step(self.grads, None, scaler, "weighted gradients")

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "speeds": self.speeds, "batch_sizes": self.batch_sizes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The resumed run keeps the batch sizes it measured (ask ``local_batch_size`` after loading)."""
        super().load_state_dict(state)
        self.speeds = None if state["speeds"] is None else tuple(state["speeds"])
        self.batch_sizes = None if state["batch_sizes"] is None else list(state["batch_sizes"])
