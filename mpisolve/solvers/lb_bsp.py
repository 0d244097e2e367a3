"""LB-BSP style synchronous SGD: static micro-batch sizes proportional to each rank's speed.

Synchronous SGD on a heterogeneous cluster waits every step for its slowest worker.
Load-balanced BSP (Chen et al., SoCC'20) sizes each worker's batch by its speed so that
all finish a step together: here once, before training, from speeds given per rank or
measured with the training loop's probe. The global batch stays that of synchronous SGD
(ranks x the configured batch); the update is the sample-weighted mean of the ranks'
gradients, reduced while backward runs as the ``allreduce`` solver does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.amp import GradScaler

from ..options import BucketOptions, MeasureOptions, option, require
from .base import BucketSolver, StepInfo, SynchronousOptions, register
from .speeds import measure_speeds, parse_speeds, proportional_batches


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
class LBBSPSolver(BucketSolver[LBBSPOptions]):
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
        self.grads = self._gradient_buckets(self.options.bucket_mb, weighted=True)
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

    def _step(self, batch_size: int | None, scaler: GradScaler | None) -> StepInfo:
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
