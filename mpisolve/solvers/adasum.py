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
from typing import Any, Literal

import torch
from torch.amp import GradScaler

from ..comm.adasum import AdasumReducer
from ..comm.buckets import Bucket, GradientBuckets, plan_buckets
from ..comm.communicator import Communicator
from ..comm.flat import FusedBuffer, HostTally
from ..options import BucketOptions, choices, option
from .base import BucketSolver, Solver, StepInfo, SynchronousOptions, register
from .nonfinite import all_finite

Mode = Literal["delta", "gradient"]
MODES = choices(Mode)


@dataclass(frozen=True, kw_only=True)
class AdasumOptions(BucketOptions, SynchronousOptions):
    """What Adasum combines, and in which units."""

    mode: Mode = option(
        "delta",
        "delta: each rank takes its local optimizer step and the model deltas are combined (Horovod's); "
        "gradient: the gradients are combined during backward, then one optimizer step",
    )


class DeltaBuckets:
    """The parameters laid in fused buckets, their start copies, and the deltas' Adasum.

    The parameters become views into one flat buffer per bucket (one copy, at
    construction), so that nothing is packed per step: ``begin`` copies each bucket's
    parameters into its start buffer; after the local optimizer step ``reduce`` writes
    each bucket's delta ``p - start`` into the buffer MPI reads (one operation), starts its
    Adasum (so buckets reduce while later deltas are computed), completes them all and
    writes ``start + adasum(delta)`` back into the parameters (one operation per bucket).
    Nothing is allocated per step.
    """

    def __init__(self, params: list[torch.nn.Parameter], comm: Communicator, *, bucket_bytes: int) -> None:
        self.reducer = AdasumReducer(comm)
        self.buckets: list[Bucket] = []
        #: Each bucket's parameters, laid end to end: the parameters are views of these.
        self.weights: list[torch.Tensor] = []
        self.starts: list[torch.Tensor] = []
        for i, members in enumerate(plan_buckets(params, bucket_bytes)):
            # CPU buckets reduced in their own dtype live in node-shared storage where Adasum's node
            # path applies: the deltas are written where node partners read them, and the result is
            # read where it lands (no copy in or out; :meth:`.AdasumReduction.wait_writable`).
            bucket = Bucket(i, [params[j] for j in members], extra=0, storage=self.reducer.storage)
            self.buckets.append(bucket)
            weights = FusedBuffer([p.shape for p in bucket.params], bucket.buffer.flat.dtype, bucket.buffer.flat.device)
            weights.pack([p.detach() for p in bucket.params])
            for p, view in zip(bucket.params, weights.views):
                p.data = view
            self.weights.append(weights.flat)
            self.starts.append(torch.empty_like(weights.flat))
            self.reducer.prepare(bucket)

    @torch.no_grad()
    def begin(self) -> None:
        for weights, start in zip(self.weights, self.starts):
            start.copy_(weights)

    @torch.no_grad()
    def reduce(self) -> None:
        """Combine the deltas of the step just taken (zeros where this rank took none)."""
        for bucket, weights, start in zip(self.buckets, self.weights, self.starts):
            self.reducer.wait_writable(bucket)
            torch.sub(weights, start, out=bucket.buffer.flat)  # the delta, in the buffer MPI reads
            bucket.to_wire()
            self.reducer.start(bucket)
        for bucket, weights, start in zip(self.buckets, self.weights, self.starts):
            self.reducer.finish(bucket)
            bucket.from_wire()
            torch.add(start, bucket.buffer.flat, out=weights)

    def close(self) -> None:
        self.reducer.close()


@register
class AdasumSolver(Solver[AdasumOptions]):
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

    Each mode is a class of its own behind this one name, picked by ``mode`` when the
    solver is made (as Horovod's ``DistributedOptimizer`` picks its Adasum class by ``op``):
    :class:`_GradientAdasum` is a bucket solver whose reducer is Adasum's,
    :class:`_DeltaAdasum` combines the deltas of local optimizer steps.
    """

    name = "adasum"
    Options = AdasumOptions

    def __new__(cls, *args: Any, **options: Any) -> AdasumSolver:
        if cls is AdasumSolver:
            cls = _GradientAdasum if options.get("mode") == "gradient" else _DeltaAdasum
        return super().__new__(cls)

    def _alone(self) -> bool:
        """One rank: Adasum of one update is the update; nothing is combined (staging forced keeps the path)."""
        return self.comm.size == 1 and not self.comm.stage_all


class _GradientAdasum(BucketSolver[AdasumOptions], AdasumSolver):
    """``mode="gradient"``: the gradients combined by Adasum in fused buckets while backward runs."""

    def setup(self) -> None:
        self._reducer = None if self._alone() else AdasumReducer(self.comm)
        self.grads = self._gradient_buckets(self.options.bucket_mb, reducer=self._reducer)

    @property
    def node_shared(self) -> bool:
        return self._reducer is not None and self._reducer.node_shared

    def _step(self, batch_size: int | None, scaler: GradScaler | None) -> StepInfo:
        return self._bucket_step(self.grads, batch_size, scaler, "combined gradients")


class _DeltaAdasum(AdasumSolver):
    """``mode="delta"`` (Horovod's): a local optimizer step on every rank, the deltas combined."""

    def setup(self) -> None:
        self.deltas: DeltaBuckets | None = None
        if not self._alone():
            # Reverse registration order, as gradient buckets: roughly the order backward ends.
            self.deltas = DeltaBuckets(self.params[::-1], self.comm, bucket_bytes=int(self.options.bucket_mb * 1e6))
        #: This step's samples and whether this rank contributes, summed beside the deltas.
        self._tally = HostTally(self.comm, GradientBuckets.TALLY)
        #: This step's agreement that every rank's local gradients are finite (None: not yet).
        self._all_finite: bool | None = None
        self._withheld = False

    @property
    def node_shared(self) -> bool:
        return self.deltas is not None and self.deltas.reducer.node_shared

    def _synchronize(self, scaler: GradScaler | None) -> None:
        """The gradients stay this rank's own (the local step needs them); the ranks agree
        whether all are finite (one 1-element allreduce), and if not, with a scaler, make
        this rank's non-finite too, so that every rank's scaler skips the step and backs
        off alike."""
        if self._all_finite is None:
            grads = [] if self._withheld else [p.grad for p in self.params if p.grad is not None]
            checked = self.nonfinite.policy != "ignore" or (scaler is not None and scaler.is_enabled())
            self._all_finite = not checked or self.nonfinite.agreed(all_finite(grads))
            if not self._all_finite and scaler is not None and scaler.is_enabled():
                first = self.params[0]
                if first.grad is None:  # a rank with no gradient (one that joined) skips as well
                    first.grad = torch.zeros_like(first)
                first.grad.view(-1)[:1].fill_(float("nan"))
        self._unscale(scaler)

    def _step(self, batch_size: int | None, scaler: GradScaler | None) -> StepInfo:
        self._synchronize(scaler)
        local = self.take_samples(batch_size)
        # The local step would poison this rank's optimizer state: the ranks agreed before it.
        if scaler is not None and scaler.is_enabled():
            applied = bool(self._all_finite)
        else:
            applied = self.nonfinite.decide(bool(self._all_finite), "local gradients", agreed=True)
        self._all_finite = None
        # A step skipped as non-finite had a rank with gradients: some rank was still in its loop.
        global_samples, contributors = 0, 1
        if applied:
            tally = self._tally
            tally.set("samples", 0 if self._withheld else local)
            tally.set("ranks", 0 if self._withheld else 1)
            tally.start()  # host values: summed beside the deltas, never read from a device
            if self.deltas is not None:
                self.deltas.begin()
            if not self._withheld:
                self._step_optimizer(scaler)
            if self.deltas is not None:
                self.deltas.reduce()
            tally.wait("adasum step's tally")
            global_samples, contributors = tally.count("samples"), tally.count("ranks")
            applied = contributors > 0
        self._end_round(contributors)
        return StepInfo(applied=applied, global_samples=global_samples if applied else 0, local_samples=local)

    def _shadow_round(self) -> bool:
        self._withheld = True
        try:
            return self._shadow_step()
        finally:
            self._withheld = False

    def _free(self) -> None:
        if self.deltas is not None:
            self.deltas.close()
        self._tally.free()
