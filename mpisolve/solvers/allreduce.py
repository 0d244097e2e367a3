"""Synchronous SGD: gradients averaged across ranks while backward runs (the baseline)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.amp import GradScaler

from ..options import BucketOptions
from .base import BucketSolver, StepInfo, SynchronousOptions, register


@dataclass(frozen=True, kw_only=True)
class AllreduceOptions(BucketOptions, SynchronousOptions):
    """The bucketed allreduce's one knob, ``bucket_mb``."""


@register
class AllreduceSolver(BucketSolver[AllreduceOptions]):
    """Data-parallel synchronous SGD, DDP-grade.

    Gradients live in fused buckets (``p.grad`` are views into them); each bucket's
    nonblocking allreduce starts from an autograd hook as soon as its gradients are
    complete, overlapping the rest of backward; ``step`` completes them, averages and
    lets the user's optimizer step. N ranks on N equal shards give the parameters one
    process would get on the whole batch.

    The average is over the ranks that contributed: all of them, except under
    ``join()`` once some have run out of data, when it is the mean of the gradients of
    the ranks still in their loops (one process on their samples, when their batches are
    of one size).
    """

    name = "allreduce"
    Options = AllreduceOptions

    def setup(self) -> None:
        self.grads = self._gradient_buckets(self.options.bucket_mb, average=True)

    def _step(self, batch_size: int | None, scaler: GradScaler | None) -> StepInfo:
        return self._bucket_step(self.grads, batch_size, scaler, "averaged gradients")
