"""Adasum: ranks' updates combined by adaptive summation instead of averaging.

Two modes. ``"delta"`` (the default, Horovod's semantics): every rank takes a local
optimizer step, the model deltas ``p - start`` are combined by Adasum and every rank
sets ``p = start + adasum(delta)``; the optimizer's state (momentum, Adam moments)
stays local to each rank. ``"gradient"``: gradients are combined by Adasum while
backward runs (each bucket as soon as it is complete), then the optimizer steps on the
combined gradient, its state identical everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..comm.adasum import AdasumReducer
from ..comm.buckets import Bucket, FusedBuffer, GradientBuckets, plan_buckets
from ..comm.communicator import Communicator
from ..options import option, require
from .base import Solver, StepInfo, register

MODES = ("delta", "gradient")


@dataclass(frozen=True, kw_only=True)
class AdasumOptions:
    """What Adasum combines, and in which units."""

    mode: Literal["delta", "gradient"] = option(
        "delta",
        "delta: each rank takes its local optimizer step and the model deltas are combined (Horovod's); "
        "gradient: the gradients are combined during backward, then one optimizer step",
    )
    bucket_mb: float = option(25.0, "size of the fused buckets reduced as units, in MB (10^6 bytes)")

    def __post_init__(self) -> None:
        require(self.mode in MODES, f"mode must be one of {', '.join(map(repr, MODES))}, got {self.mode!r}")
        require(self.bucket_mb > 0, f"bucket_mb must be > 0, got {self.bucket_mb}")


class DeltaBuckets:
    """The parameters' start copies and deltas in persistent fused buckets.

    ``begin`` copies the parameters into the start buffers; after the local optimizer
    step ``reduce`` writes each bucket's delta, starts its Adasum (so buckets reduce
    while later deltas are computed), completes them all and sets
    ``p = start + adasum(delta)``. The first bucket carries this rank's sample count as
    a trailing element that the reduction sums. Nothing is allocated per step.
    """

    def __init__(self, params: list[torch.nn.Parameter], comm: Communicator, *, bucket_bytes: int) -> None:
        self.reducer = AdasumReducer(comm)
        self.buckets: list[Bucket] = []
        self.starts: list[FusedBuffer] = []
        for i, members in enumerate(plan_buckets(params, bucket_bytes)):
            bucket = Bucket(i, [params[j] for j in members], extra=1 if i == 0 else 0)
            self.buckets.append(bucket)
            self.starts.append(
                FusedBuffer([p.shape for p in bucket.params], bucket.buffer.flat.dtype, bucket.buffer.flat.device)
            )
            self.reducer.prepare(bucket)
        # The count rides in the wire buffer itself: a half-precision buffer would round it.
        self._count = self.buckets[0].wire[-1:]

    @torch.no_grad()
    def begin(self) -> None:
        for bucket, start in zip(self.buckets, self.starts):
            torch._foreach_copy_(start.views, bucket.params)

    @torch.no_grad()
    def reduce(self, local_samples: int) -> int:
        """Combine the deltas of the step just taken; returns the global sample count."""
        for bucket, start in zip(self.buckets, self.starts):
            for p, s, d in zip(bucket.params, start.views, bucket.buffer.views):
                torch.sub(p, s, out=d)
            bucket.to_wire()
            if bucket.index == 0:
                self._count.fill_(local_samples)
            self.reducer.start(bucket)
        for bucket, start in zip(self.buckets, self.starts):
            self.reducer.finish(bucket)
            bucket.from_wire()
            for p, s, d in zip(bucket.params, start.views, bucket.buffer.views):
                torch.add(s, d, out=p)
        return int(round(self._count.item()))

    def close(self) -> None:
        self.reducer.close()


@register
class AdasumSolver(Solver):
    """Data-parallel training with Adasum in place of the average (Maleki et al., MLSys 2021).

    Adasum combines two ranks' updates g1, g2 per tensor as
    ``(1 - g1.g2 / 2|g1|^2) g1 + (1 - g1.g2 / 2|g2|^2) g2``: orthogonal updates add up,
    parallel ones average, so the combined step adapts between the sum and the mean
    and large global batches need less learning-rate retuning. Any number of ranks
    (see :mod:`mpisolve.comm.adasum` for the order).

    In delta mode the local optimizer step needs every gradient, so the combination
    starts after backward (buckets still reduce while later deltas are computed); in
    gradient mode each bucket's combination starts from the autograd hooks during
    backward, as the allreduce solver's sums do.
    """

    name = "adasum"
    Options = AdasumOptions

    def setup(self) -> None:
        bucket_bytes = int(self.options.bucket_mb * 1e6)
        self.grads: GradientBuckets | None = None
        self.deltas: DeltaBuckets | None = None
        if self.options.mode == "gradient":
            self.grads = GradientBuckets(
                self.params,
                self.comm,
                bucket_bytes=bucket_bytes,
                reducer=AdasumReducer(self.comm),
                samples=self.samples_seen,
            )
        else:
            # Reverse registration order, as gradient buckets: roughly the order backward ends.
            self.deltas = DeltaBuckets(self.params[::-1], self.comm, bucket_bytes=bucket_bytes)

    def zero_grad(self) -> None:
        if self.grads is not None:
            self.grads.zero_()
        else:
            super().zero_grad()

    def step(self, batch_size: int | None = None) -> StepInfo:
        if self.grads is not None:
            global_samples = self.grads.finish(local_samples=batch_size)
            local = self.take_samples(batch_size)
            if not self.nonfinite.ok([b.buffer.flat for b in self.grads.buckets], "combined gradients"):
                return StepInfo(applied=False, global_samples=0, local_samples=local)
            self.optimizer.step()
        else:
            assert self.deltas is not None
            local = self.take_samples(batch_size)
            # The local step would poison this rank's optimizer state: ranks agree before it.
            grads = [p.grad for p in self.params if p.grad is not None]
            if not self.nonfinite.ok(grads, "local gradients", agree=True):
                return StepInfo(applied=False, global_samples=0, local_samples=local)
            self.deltas.begin()
            self.optimizer.step()
            global_samples = self.deltas.reduce(local)
        return StepInfo(applied=True, global_samples=global_samples, local_samples=local)

    def close(self) -> None:
        if not self.closed:
            if self.grads is not None:
                self.grads.close()
            if self.deltas is not None:
                self.deltas.close()
        super().close()
