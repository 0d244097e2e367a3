"""Synchronous SGD: gradients averaged across ranks while backward runs (the baseline)."""

from __future__ import annotations

from dataclasses import dataclass

from ..comm.buckets import GradientBuckets
from ..options import option, require
from .base import Solver, StepInfo, register


@dataclass(frozen=True, kw_only=True)
class AllreduceOptions:
    """The bucketed allreduce's one knob."""

    bucket_mb: float = option(25.0, "size of the fused gradient buckets, in MB (10^6 bytes), as DDP's bucket_cap_mb")

    def __post_init__(self) -> None:
        require(self.bucket_mb > 0, f"bucket_mb must be > 0, got {self.bucket_mb}")


@register
class AllreduceSolver(Solver):
    """Data-parallel synchronous SGD, DDP-grade.

    Gradients live in fused buckets (``p.grad`` are views into them); each bucket's
    nonblocking allreduce starts from an autograd hook as soon as its gradients are
    complete, overlapping the rest of backward; ``step`` completes them, averages and
    lets the user's optimizer step. N ranks on N equal shards give the parameters one
    process would get on the whole batch.
    """

    name = "allreduce"
    Options = AllreduceOptions

    def setup(self) -> None:
        self.grads = GradientBuckets(
            self.params,
            self.comm,
            bucket_bytes=int(self.options.bucket_mb * 1e6),
            samples=self.samples_seen,
            scale=1.0 / self.comm.size,
        )

    def zero_grad(self) -> None:
        self.grads.zero_()

    def step(self, batch_size: int | None = None) -> StepInfo:
        global_samples = self.grads.finish(local_samples=batch_size)
        local = self.take_samples(batch_size)
        # The averaged gradients are the same everywhere: every rank decides alike, unasked.
        if not self.nonfinite.ok(self.grads.reduced(), "averaged gradients"):
            return StepInfo(applied=False, global_samples=0, local_samples=local)
        self.optimizer.step()
        return StepInfo(applied=True, global_samples=global_samples, local_samples=local)

    def close(self) -> None:
        if not self.closed:
            self.grads.close()
        super().close()
