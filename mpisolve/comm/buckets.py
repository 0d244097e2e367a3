"""Gradient buckets reduced during backward.

:class:`GradientBuckets` makes a model's gradients such views and starts each bucket's
nonblocking reduction from autograd hooks as soon as all of the bucket's gradients have
been accumulated, in a fixed bucket order every rank follows, so communication overlaps
the rest of the backward pass.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from .communicator import MPI_TYPES, Communicator, PersistentCollective
from .engine import InFlight, Reusable
from .flat import FusedBuffer, RidingTally, Tally
from .readback import Readback, write_finite_probe
from .reusable import reusable_allreduce
from .shm import NodeSumReducer, node_group, node_path, takes

#: Distinct step tallies a :class:`GradientBuckets` keeps as made :class:`Reduction`s (cleared when full).
MAX_KEPT_REDUCTIONS = 256

#: float16 and bfloat16 have no MPI reduction type; they are reduced in float32.
HALF_DTYPES = (torch.float16, torch.bfloat16)


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` is reduced in over MPI."""
    if dtype in HALF_DTYPES:
        return torch.float32
    if dtype not in MPI_TYPES or not dtype.is_floating_point:
        raise TypeError(f"mpisolve reduces floating-point tensors only, got {dtype}")
    return dtype


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one float dtype hold the same bits (NaNs included)."""
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    return torch.equal(a.view(bits), b.view(bits))


def plan_buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Group tensor indices, in the given order, into buckets of one dtype and device.

    A bucket is closed when adding the next tensor would pass ``bucket_bytes`` (a tensor
    larger than that gets a bucket of its own). Tensors of a dtype or device interleaved
    with others keep their relative order within their own buckets.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {bucket_bytes}")
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    closed: list[list[int]] = []
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        members, size = open_buckets.get(key, ([], 0))
        if members and size + nbytes > bucket_bytes:
            closed.append(members)
            members, size = [], 0
        members.append(i)
        open_buckets[key] = (members, size + nbytes)
    closed.extend(m for m, _ in open_buckets.values() if m)
    # Every bucket is ordered by its first member, so all ranks agree on the order.
    return sorted(closed, key=lambda members: members[0])


class Bucket:
    """One bucket of gradients: their storage, the wire buffer MPI reduces, and its request.

    ``buffer`` is where backward writes; ``result`` where the reduced gradients lie after
    ``finish``: the same buffer, except for node-shared buckets (``node``: the
    :class:`NodeSumReducer` giving the storage) on the bandwidth path, whose sum is read in
    place from the window (``shared``).

    ``storage``: a reducer's offer of storage for a CPU bucket reduced in its own dtype
    (``storage(numel, dtype)``, collective over the node; None where it has none), which
    the bucket then lives in, so that the reducer works in place (Adasum's node path).
    """

    def __init__(
        self,
        index: int,
        params: list[torch.nn.Parameter],
        extra: int,
        node: NodeSumReducer | None = None,
        storage: Callable[[int, torch.dtype], torch.Tensor | None] | None = None,
    ) -> None:
        self.index = index
        self.params = params
        dtype = params[0].dtype
        shapes = [p.shape for p in params]
        if node is None:
            wire = wire_dtype(dtype)
            numel = sum(s.numel() for s in shapes) + extra
            offered = None
            if storage is not None and params[0].device.type == "cpu" and wire == dtype:
                offered = storage(numel, dtype)
            if offered is None:
                self.buffer = FusedBuffer(shapes, dtype, params[0].device, extra=extra)
            else:
                self.buffer = FusedBuffer(shapes, dtype, extra=extra, flat=offered)
            # Half-precision gradients are reduced through a float32 twin of the buffer.
            self.wire = self.buffer.flat if wire == dtype else torch.zeros_like(self.buffer.flat, dtype=wire)
        else:
            numel = sum(s.numel() for s in shapes) + extra
            self.buffer = FusedBuffer(shapes, dtype, extra=extra, flat=node.allocate(numel, dtype))
            self.wire = self.buffer.flat  # the node-shared kernel reads half precision as it is
        self.result = self.buffer
        if node is not None and node.shared(index):
            self.result = FusedBuffer(shapes, dtype, extra=extra, flat=node.result(index))
        #: Whether the result is a sum the node's ranks share (read in place, written by none).
        self.shared = self.result is not self.buffer
        #: The wire's gradient elements (without the trailing extra ones).
        self.wire_values = self.wire[: self.buffer.numel]
        self.pending = len(params)

    def to_wire(self) -> None:
        if self.wire is not self.buffer.flat:
            self.wire.copy_(self.buffer.flat)

    def from_wire(self, scale: torch.Tensor | None = None) -> None:
        """Bring the reduced wire buffer back into the gradients, times ``scale`` (a tensor on the
        buffer's device, so that a scale the reduction produced is never read by the host)."""
        if scale is not None:
            self.wire_values.mul_(scale)
        if self.wire is not self.buffer.flat:
            self.buffer.flat.copy_(self.wire)


class BucketReducer(Protocol):
    """How a bucket's wire buffer is reduced: started from a hook, completed in ``step``."""

    def prepare(self, bucket: Bucket) -> None:
        """Called once per bucket at construction (allocate requests, buffers)."""

    def start(self, bucket: Bucket) -> None:
        """Start reducing ``bucket.wire`` (nonblocking where the reduction allows)."""

    def progress(self) -> None:
        """Drive outstanding reductions (called from hooks while backward runs)."""

    def finish(self, bucket: Bucket) -> None:
        """Complete the bucket's reduction and leave the result in ``bucket.wire``."""

    def close(self) -> None:
        """Release MPI resources."""


def _completion(request: Reusable, what: str) -> Callable[[], None]:
    """How to wait for a bucket's sum, made once: MPI's in ``MPI_Wait`` where its communicator
    allows it, the torch.distributed engine's by its own wait."""
    if isinstance(request, PersistentCollective):
        return functools.partial(request.wait, what, in_mpi=True)
    return functools.partial(request.wait, what)


class SumReducer:
    """Sums each bucket with a persistent nonblocking allreduce.

    Completed by the communicator's polled wait, or where its ranks yield their cores and its
    waits run no interrupts (:meth:`.Communicator.waits_in_mpi`: the solvers' close notices,
    abs-sgd's round), in ``MPI_Wait`` under the watchdog thread, which aborts the job past the
    timeout where the polled wait raises :class:`~mpisolve.errors.CommTimeout`.
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.requests: dict[int, Reusable] = {}
        self._completions: dict[int, Callable[[], None]] = {}
        self._inflight = InFlight()

    def prepare(self, bucket: Bucket) -> None:
        request = self.requests[bucket.index] = reusable_allreduce(self.comm, bucket.wire, "sum")
        self._completions[bucket.index] = _completion(request, f"gradient allreduce of bucket {bucket.index}")

    def start(self, bucket: Bucket) -> None:
        self._inflight.start(self.requests[bucket.index])

    def progress(self) -> None:
        self._inflight.progress()

    def finish(self, bucket: Bucket) -> None:
        self._completions[bucket.index]()
        if bucket.index == len(self.requests) - 1:  # buckets finish in order: the step's last
            self._inflight.clear()

    def close(self) -> None:
        for req in self.requests.values():
            req.free()
        self.requests.clear()
        self._completions.clear()
        self._inflight.clear()


class Unreduced:
    """One rank: a bucket's reduction over the ranks is the bucket as it is, so nothing is done."""

    def prepare(self, bucket: Bucket) -> None:
        pass

    def start(self, bucket: Bucket) -> None:
        pass

    def progress(self) -> None:
        pass

    def finish(self, bucket: Bucket) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Reduction:
    """What one step's reduction covered: ``samples`` summed over the ranks, and the
    ``ranks`` that contributed (a rank that withheld, in ``join``'s shadow rounds, is not one).
    ``finite``: whether every reduced value is finite (True where it was not checked)."""

    samples: int
    ranks: int
    finite: bool = True


class GradientBuckets:
    """A model's gradients as views into fused buckets, reduced while backward runs.

    Parameters are bucketed in reverse registration order (roughly the order backward
    produces their gradients). Each ``p.grad`` is made a view into its bucket, so
    autograd accumulates straight into the buffer MPI sends. When a bucket's last
    gradient of the backward pass arrives its reduction starts, but only after every
    earlier bucket's has, so all ranks start collectives in the same order. ``finish``
    starts whatever backward did not (parameters that got no gradient contribute zeros),
    completes everything and, with ``average``, divides by the contributing ranks.

    One step's life: armed (waiting for gradients) -> launched (some buckets in flight)
    -> reduced (``finish``: the result is in the gradients; ``finish`` again returns it
    without reducing again) -> armed again by ``rearm``, which the solver calls once it
    has applied the step. Any way of zeroing the gradients works: :meth:`zero_` fills
    the buckets in place (the copy-free way); a gradient set to ``None`` (or replaced)
    comes back into its bucket when autograd next accumulates it, at the cost of one
    copy, or is zeroed in ``finish`` if it got none.

    Under :meth:`no_sync` backward only accumulates into the buckets; the next backward
    outside it launches them. ``passes`` (Horovod's ``backward_passes_per_step``) does the
    same by count: a gradient reports to its bucket on its ``passes``-th accumulation since
    the last step. A second backward outside ``no_sync`` before the step is
    refused (its gradients would land in buffers already being reduced).

    Every step's reduction also sums a tally of two elements at no extra message: this
    rank's sample count (``samples()``, read when the first bucket starts) and 1 (0 when
    this rank withholds: :meth:`withhold`), so every rank learns the global count and how
    many ranks contributed. On MPI's path they ride at the end of the first bucket.
    ``weighted``: the result is the sample-weighted mean sum_r n_r g_r / sum_r n_r (each
    rank's gradients the mean over its own ``samples()``; ``lb-bsp``'s uneven micro-batches):
    each rank weighs its bucket by its count over the last step's global count (1 before the
    first; the same on every rank), so that a step with the same count (every step of static
    micro-batches) has the mean as summed, with no pass over it after; another count scales
    the sum by the last count over this one.

    **Node-shared buckets**: with the default sum or ``weighted`` (not half precision:
    there sum_r n_r g_r would overflow before the division), CPU parameters MPI takes
    directly, more than one rank per node (:func:`.shm.node_group`; off with
    ``Communicator(node_shm=False)`` or ``MPISOLVE_NODE_SHM=0``) and gradients of at least
    the group's crossover in all (:func:`.shm.node_path`; smaller ones take MPI's path, faster
    there), each bucket is summed in
    a node-shared window (:class:`.shm.NodeSumReducer`): the node's ranks sum as soon as
    all have written the bucket (the average's ``1 / ranks`` fused into the sum), nodes
    exchange by MPI, and the tally rides in the first bucket's round in float64 rows of
    its own (exact whatever the gradients' dtype). A bucket of the latency path keeps its
    own storage and its sum lands there, in place, as on MPI's path. A bucket of the
    bandwidth path lives in the window, where backward writes this rank's slot; after
    ``finish`` each of its ``p.grad`` is a view of the sum in the window, read in place by
    the node's ranks; a hook points it back at the slot before the next backward
    accumulates into it (copying the sum there when the gradient was not zeroed), and
    :meth:`rearm` waits until every local rank has stepped, so that zeroing in place
    cannot reach a neighbour still reading the sum. Other writes to a shared sum must not
    happen: ``finish(writable=True)`` (``synchronize``, a GradScaler's unscale) gives each
    rank its own copy first, as do ``shared_result=False`` (for solvers that change
    gradients in place, as K-FAC's preconditioner does), a step some ranks withheld from
    (the average's divisor is then the contributing ranks, not the one fused into the sum)
    and a ``weighted`` step whose global sample count is not the last step's (the sum is
    then rescaled by the last count over this one).
    The user's optimizer may write ``p.grad`` in place too (``SGD(nesterov=True,
    foreach=True)`` adds its momentum there, a user's optimizer may scale it): its first
    applied step runs on this rank's own copy, and :meth:`stepped` looks whether it wrote
    it; one that did gets its own copy at every step, the others read the sums in place
    from then on (and a later in-place write is an error: :meth:`stepped`).

    ``extra_reads``: slots of a solver's own (:attr:`extra_reads`, on the buckets' device)
    read by the host with the step's tally, so that a step waits on the device once.

    Arming and launching live here; where a bucket's storage lives and how it is
    reduced are :class:`Bucket`'s and the :class:`BucketReducer`'s.
    """

    #: The tally: the sample count, the contributing ranks.
    TALLY = Tally(samples=1, ranks=1)

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        comm: Communicator,
        *,
        bucket_bytes: int,
        reducer: BucketReducer | None = None,
        samples: Callable[[], int] | None = None,
        average: bool = False,
        weighted: bool = False,
        shared_result: bool = True,
        extra_reads: int = 0,
        passes: int = 1,
    ) -> None:
        if passes < 1:
            raise ValueError(f"passes must be >= 1, got {passes}")
        self.comm = comm
        self.passes = passes
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no parameters that require gradients")
        if weighted and (average or reducer is not None or samples is None):
            raise ValueError("weighted buckets take samples=..., and neither average nor a reducer of their own")
        ordered = self.params[::-1]
        self.average = average
        self.weighted = weighted
        self.shared_result = shared_result
        group = node_group(comm) if reducer is None else None
        self.node: NodeSumReducer | None = None
        half = any(p.dtype in (torch.float16, torch.bfloat16) for p in self.params)
        #: One rank, the default sum, staging not forced: there is no one to talk to. The gradients
        #: stay the parameters' own (no buckets, no hooks; zeroing sets them to None, as torch's
        #: default), and ``finish`` only reads the tally and the finite probe.
        self.alone = comm.size == 1 and not comm.stage_all and reducer is None
        if self.alone:
            plan_buckets(ordered, bucket_bytes)  # the same checks of bucket_bytes
            self.reducer: BucketReducer = Unreduced()
        elif (
            node_path(group, sum(p.numel() * p.element_size() for p in self.params))
            and all(takes(comm, p) for p in self.params)
            and not (weighted and half)
        ):
            assert group is not None  # node_path says there is one
            self.node = NodeSumReducer(group, 1.0 / comm.size if average else 1.0, self.TALLY.size)
            self.reducer = self.node
        elif reducer is not None:
            self.reducer = reducer
        else:
            self.reducer = SumReducer(comm)
        self.buckets: list[Bucket] = []
        self._slot: dict[int, int] = {}  # id(param) -> its index in the two lists below
        self._bucket_of: list[Bucket] = []
        self._view_of: list[torch.Tensor] = []
        for i, members in enumerate([] if self.alone else plan_buckets(ordered, bucket_bytes)):
            extra = self.TALLY.size if i == 0 and self.node is None else 0
            bucket = Bucket(i, [ordered[j] for j in members], extra=extra, node=self.node)
            self.buckets.append(bucket)
            for p, view in zip(bucket.params, bucket.buffer.views):
                self._slot[id(p)] = len(self._view_of)
                self._bucket_of.append(bucket)
                self._view_of.append(view)
                p.grad = view
            self.reducer.prepare(bucket)
        if self.alone:  # summed over this rank only: the host reads back what it wrote
            sent = summed = torch.zeros(self.TALLY.size, dtype=torch.float64)
        elif self.node is None:
            first = self.buckets[0]
            # Written into the wire buffer and summed in place: half-precision buckets travel in
            # float32, which holds any realistic count exactly, where bfloat16 would round it past 256.
            sent = summed = first.wire[first.buffer.numel :]
        else:
            sent, summed = self.node.tally_input, self.node.tally_result
        self._local_samples = 0  # this step's, as the tally is summed in place
        #: What the host reads of a step, in one read: the summed tally, then the finite probe of the
        #: reduced values (:func:`~.readback.finite_probe`), one per bucket, each taken as its sum
        #: completes (alone: one, over the parameters' own gradients).
        probes = max(1, len(self.buckets))
        self._readback = Readback(self.TALLY.size + probes + extra_reads, self.params[0].device)
        self._tally = RidingTally(self.TALLY, sent, summed, self._readback)
        self._probes = self._readback.values[self.TALLY.size : self.TALLY.size + probes]
        self._probes_at = slice(self.TALLY.size, self.TALLY.size + probes)
        #: ``extra_reads`` slots a solver fills on the device before ``finish``, read with the step's tally.
        self.extra_reads = self._readback.values[self.TALLY.size + probes :]
        #: MPI's path: what the sums are scaled by (the average's 1 / the contributing ranks, the weighted
        #: mean's expected over actual count), on the buckets' device (on a device, never read by the host).
        self._scale = torch.ones((), dtype=summed.dtype, device=summed.device)
        self._expected_on_device = torch.ones((), dtype=summed.dtype, device=summed.device)  # its numerator there
        self._ranks_at, self._samples_at = self.TALLY.at["ranks"], self.TALLY.at["samples"]
        self._ranks_out, self._samples_out = summed[self._ranks_at], summed[self._samples_at]
        #: Where the summed tally is host memory, the host reads the counts there as the first sum lands
        #: (no wait); then every rank contributing, the usual step, takes this kept 1 / size.
        self._summed_host = self._tally.summed_host if summed.device.type == "cpu" else None
        self._one_over_size = torch.full((), 1.0 / comm.size, dtype=summed.dtype, device=summed.device)
        #: Reductions by their summed tally: most steps repeat one, and making one costs more than finding it.
        self._reductions: dict[tuple[float, float, bool], Reduction] = {}
        self.samples = samples
        self._generation = 0  # this step's number: a parameter reported in it carries it
        self._reported = [-1] * len(self._view_of)
        self._arrivals = [0] * len(self._view_of)  # accumulations this step, counted when passes > 1
        self._next = 0  # the next bucket to start, in bucket order
        #: Each bucket's storage version (``Tensor._version``) once its reduction started: any later
        #: in-place change of a gradient before ``finish`` bumps it (the reducers' own writes do not).
        self._started_version = [0] * len(self.buckets)
        self._changed: list[Bucket] = []  # buckets changed after their reduction started, this step
        self._refused = False  # a backward was refused this step (it changed the gradients, and was told)
        self._reduced: Reduction | None = None
        self._withheld = False
        self._accumulating = 0
        #: Whether backward brought a gradient since the last step (under no_sync too; not watched over one rank).
        self.backward_ran = False
        self._hooks = [] if self.alone else [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        #: Buckets whose storage no local rank still reads (free to write: a shared sum's slot may be read).
        self._writable = [True] * len(self.buckets)
        #: Whether some gradients are views of shared sums in the window (else all are their buckets').
        self._in_window = False
        # Gradients that are views of shared sums after a step are pointed back at their bucket before backward.
        self._shared_buckets = any(bucket.shared for bucket in self.buckets)
        shared = [p for bucket in self.buckets if bucket.shared for p in bucket.params]
        self._hooks += [p.register_hook(functools.partial(self._before_accumulate, p)) for p in shared]
        # A step whose shared sums were read in place ends waiting for the node's other ranks.
        self._release = self.node.release if self.node is not None and shared_result else None
        #: Whether the optimizer reads the shared sums in place: None until its first applied step
        #: (on this rank's own copy) shows whether it writes ``p.grad`` (:meth:`stepped`); False where
        #: no sum is shared.
        self._read_in_place: bool | None = None if self._release is not None and self._shared_buckets else False
        self._window_version = [0] * len(self.buckets)  # each shared sum's version, as the optimizer got it
        #: Whether this step's own copy of the shared sums was rescaled (:meth:`stepped` cannot compare it).
        self._rescaled_copy = False
        #: Weighted sums: the global sample count each rank divides its weight by (the last step's;
        #: 1 before the first), the same on every rank.
        self._expected_samples = 1

    @property
    def accumulating(self) -> bool:
        """Whether backward passes now only accumulate (inside :meth:`no_sync`)."""
        return self._accumulating > 0

    @property
    def in_flight(self) -> bool:
        """Whether a bucket of this step has started and the step's reduction is not complete."""
        return self._next > 0 and self._reduced is None

    # ------------------------------------------------------------------ hooks
    def _before_accumulate(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Shared sums: make the bucket writable and ``param.grad`` its view before autograd adds into it."""
        i = self._slot[id(param)]
        self._claim(self._bucket_of[i])
        view = self._view_of[i]
        if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)  # not zeroed since the step: the sum accumulates on
            param.grad = view

    def _claim(self, bucket: Bucket) -> None:
        """Shared sums: wait until no local rank still reads ``bucket``'s slot (before writing it)."""
        if not self._writable[bucket.index]:
            assert self.node is not None
            self.node.wait_writable(bucket.index)
            self._writable[bucket.index] = True

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        i = self._slot[id(param)]
        view = self._view_of[i]
        assert param.grad is not None  # a post-accumulate-grad hook runs once the gradient is written
        if param.grad.data_ptr() != view.data_ptr():
            # Set to None (or replaced) since: the fresh gradient comes into the bucket.
            self._claim(self._bucket_of[i])
            view.copy_(param.grad)
            param.grad = view
        self.backward_ran = True
        if self._accumulating:
            return
        if self.passes > 1:
            self._arrivals[i] += 1
            if self._arrivals[i] < self.passes:
                return
        if self._reduced is not None:
            self._refused = True
            raise RuntimeError(
                "mpisolve: backward() ran after solver.synchronize() and before solver.step(): the reduced "
                "gradients were overwritten; call step() first"
            )
        if self._reported[i] == self._generation:
            self._refused = True
            raise RuntimeError(
                f"mpisolve: a second backward() reached parameter {tuple(param.shape)} before solver.step(): its "
                "gradient is already being reduced. For gradient accumulation, run every backward but the "
                "last inside `with solver.no_sync():`"
            )
        self._reported[i] = self._generation
        bucket = self._bucket_of[i]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._start_ready()
        self.reducer.progress()

    def _start(self, bucket: Bucket) -> None:
        self._claim(bucket)  # a bucket backward did not touch (unused parameters); the first: the tally too
        bucket.to_wire()
        if bucket.index == 0:
            self._write_tally()
            self._tally.send()
        if self.weighted:  # this rank's samples over the expected count (half precision: in its float32 twin)
            bucket.wire_values.mul_(self._local_samples / self._expected_samples)
        self.reducer.start(bucket)
        self._started_version[bucket.index] = bucket.buffer.flat._version

    def _write_tally(self) -> None:
        """This rank's tally of the step: its samples, and whether it contributes."""
        withheld = self._withheld
        self._local_samples = 0 if withheld or self.samples is None else self.samples()
        self._tally.set("samples", self._local_samples)
        self._tally.set("ranks", 0 if withheld else 1)

    def _start_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._start(self.buckets[self._next])
            self._next += 1

    # ------------------------------------------------------------------ steps
    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes inside only accumulate into the buckets; the next one outside launches them."""
        if self.in_flight or self._reduced is not None:
            raise RuntimeError(
                "mpisolve: solver.no_sync() entered after a backward() outside it in the same step: that "
                "backward's gradients are already being reduced. Run every backward but the last inside no_sync()"
            )
        return self._accumulate()

    @contextmanager
    def _accumulate(self) -> Iterator[None]:
        self._accumulating += 1
        try:
            yield
        finally:
            self._accumulating -= 1

    def zero_(self) -> None:
        """Zero every gradient in place (one fill per bucket); gradients set to None become views again.
        Alone: the gradients are set to None (torch's default zeroing: backward then writes them afresh)."""
        if self.in_flight:
            raise RuntimeError(
                "mpisolve: solver.zero_grad() between backward() and step(): the gradients are being reduced; "
                "zero them before the forward pass (or after step())"
            )
        self._zero_views()

    def withhold(self) -> None:
        """This rank contributes nothing to this step: zeros, no samples, not counted as a rank."""
        if self.in_flight or self._reduced is not None:
            raise RuntimeError("mpisolve: a rank can withhold only from a step it has not started")
        self._withheld = True
        self._zero_views()

    def _zero_views(self) -> None:
        """Every bucket zeroed and every gradient its view again (alone: every gradient None)."""
        if self.alone:
            for p in self.params:
                p.grad = None
        for bucket in self.buckets:
            self._claim(bucket)
            bucket.buffer.flat.zero_()
            for p, view in zip(bucket.params, bucket.buffer.views):
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
        self._in_window = False

    def finish(self, *, writable: bool = False, check_finite: bool = False) -> Reduction:
        """Start what backward did not, complete every bucket, average if asked; the step's :class:`Reduction`.

        Called again before :meth:`rearm`, it returns the same reduction without reducing
        again. ``writable``: the gradients are about to be changed in place before the step
        (clipping, a GradScaler's unscale): node-shared sums are copied into this rank's
        own storage first (on MPI's path and the latency path they are this rank's already).
        ``check_finite``: also say whether every reduced value is finite (``Reduction.finite``).
        The host waits for the device once, for the tally and the check together
        (:class:`~.readback.Readback`).
        """
        reduced = self._reduced
        if reduced is None:
            reduced = self._reduced = self._reduce(check_finite)
            if self._changed:
                raise RuntimeError(self._changed_message())
        if writable and self._in_window:
            self._own()
        return reduced

    def _changed_message(self) -> str:
        changed, self._changed = self._changed, []
        shapes = ", ".join(str(tuple(p.shape)) for bucket in changed for p in bucket.params[:3])
        return (
            f"mpisolve: gradients were changed in place after their reduction started (after backward(), before "
            f"step() or synchronize(); in the bucket(s) of parameters {shapes}): the reduction may or may not have "
            "read the change, so the ranks' models may differ. Clip, scale or unscale the gradients after "
            "solver.synchronize(), which completes the reduction, and give a GradScaler to "
            "synchronize(scaler=...) or step(scaler=...) instead of calling scaler.unscale_ yourself"
        )

    def _reduce(self, check_finite: bool) -> Reduction:
        if self.alone:
            self._write_tally()
            return self._read_back(check_finite)
        for bucket in self.buckets[self._next :]:
            if bucket.pending:
                self._take_unreported(bucket)
        while self._next < len(self.buckets):
            self._start(self.buckets[self._next])
            self._next += 1
        started = self._started_version
        if not self._refused:
            self._changed = [b for b in self.buckets if b.buffer.flat._version != started[b.index]]
        scale = None
        for bucket in self.buckets:
            self.reducer.finish(bucket)
            if self.node is None:
                if bucket.index == 0 and self.average:  # the counts are summed in the first bucket
                    scale = self._average_scale()
                elif bucket.index == 0 and self.weighted:
                    scale = self._weighted_scale()
                bucket.from_wire(scale)
            if check_finite:  # as the bucket's sum completes, while it is fresh (on a GPU: queued behind it)
                write_finite_probe([bucket.result.flat], self._probes[bucket.index])
        expected = self._expected_samples
        reduction = self._read_back(check_finite)
        samples, ranks = reduction.samples, reduction.ranks
        if self.weighted and samples > 0:  # every rank's next weight (the same count on every rank)
            self._expected_samples = samples
        if self.node is None:
            return reduction
        if self._shared_buckets:  # local ranks may still be reading this round's slots, the buckets' storage
            self._writable = [not bucket.shared for bucket in self.buckets]
        if self.weighted and samples != expected:  # sum_r n_r g_r / expected, made / samples
            self._own(expected / samples if samples > 0 else 0.0)
        elif self.average and 0 < ranks < self.comm.size:
            self._own(self.comm.size / ranks)  # the sum was scaled by 1 / size: make it 1 / ranks
        elif self._read_in_place:
            for bucket in self.buckets:
                if bucket.shared:
                    for p, view in zip(bucket.params, bucket.result.views):
                        p.grad = view
                    self._window_version[bucket.index] = bucket.result.flat._version
                    self._in_window = True
        else:
            self._own()
        return reduction

    def _average_scale(self) -> torch.Tensor | None:
        """MPI's path, the first bucket's sum complete: what to scale the sums by for the average (None: nothing).

        On a device, ``1 / max(ranks, 1)`` computed there, never read by the host (no rank
        contributing: the sums are 0 and stay 0). In host memory, the host reads the count:
        the kept ``1 / size`` where every rank contributed, none where none did, else ``1 / ranks``.
        """
        host = self._summed_host
        if host is None:
            return torch.clamp(self._ranks_out, min=1.0, out=self._scale).reciprocal_()
        ranks = host[self._ranks_at]
        if ranks == self.comm.size:
            return self._one_over_size
        return self._scale.fill_(1.0 / ranks) if ranks else None

    def _weighted_scale(self) -> torch.Tensor | None:
        """MPI's path, weighted, the first bucket's sum complete: what to scale the sums by (None: nothing),
        expected / actual count. On a device computed there, never read by the host; in host memory none
        where the count is the expected one (the usual step) or 0 (every rank weighed its sums by 0)."""
        expected = self._expected_samples
        host = self._summed_host
        if host is None:
            torch.clamp(self._samples_out, min=1.0, out=self._scale)
            return torch.div(self._expected_on_device.fill_(expected), self._scale, out=self._scale)
        samples = host[self._samples_at]
        return None if samples == expected or not samples else self._scale.fill_(expected / samples)

    def stepped(self) -> None:
        """After the optimizer stepped on this step's gradients (before :meth:`rearm`).

        Node-shared sums: the first time its copy is the sums as they are (not rescaled),
        whether the optimizer wrote ``p.grad`` (its own copy, compared bit for bit with the
        shared sums) decides whether it may read them in place from now on. Once it does, a
        write (seen by the version counter: one through ``.data`` is not) is an error: the
        node's ranks read those sums at once.
        """
        if self._read_in_place is None:
            if self._rescaled_copy:  # not the sums as they are: a later step's copy decides
                return
            self._read_in_place = all(_same_bits(b.buffer.flat, b.result.flat) for b in self.buckets if b.shared)
        elif self._in_window:
            version = self._window_version
            if any(b.result.flat._version != version[b.index] for b in self.buckets if b.shared):
                raise RuntimeError(
                    "mpisolve: the optimizer wrote p.grad in place, which it did not at its first step: the "
                    "gradients are one node-shared sum that the node's ranks read at once, so their models may now "
                    "differ. Keep this optimizer's sums on MPI's path (MPISOLVE_NODE_SHM=0, or a solver made on "
                    "mpisolve.Communicator(node_shm=False))"
                )

    def _read_back(self, check_finite: bool) -> Reduction:
        """The step's :class:`Reduction`: the summed tally (whole numbers: float64 on the node path,
        the wire's dtype on MPI's) and, if asked, whether the reduced values are finite, read at once."""
        self._tally.stage()
        # The probes (several ranks: one per bucket, written in _reduce) are of the sums as they will be
        # applied, but for a positive factor (1 / ranks, 1 / samples).
        if check_finite and self.alone:
            write_finite_probe(self.reduced(), self._probes[0])
        values = self._readback.fetch()
        tally = self._tally.summed_host
        key = (tally[0], tally[1], not check_finite or math.isfinite(sum(values[self._probes_at])))
        reduction = self._reductions.get(key)
        if reduction is None:
            if len(self._reductions) >= MAX_KEPT_REDUCTIONS:  # sample counts that vary step to step
                self._reductions.clear()
            reduction = self._reductions[key] = Reduction(int(round(key[0])), int(round(key[1])), key[2])
        return reduction

    def extra_values(self) -> memoryview:
        """After ``finish``: the host's copy of :attr:`extra_reads` (read in the step's one read)."""
        return self._readback.host[self._probes_at.stop :]

    def _own(self, rescale: float | None = None) -> None:
        """Node-shared buckets: the shared sums copied into this rank's storage, every sum times ``rescale``
        (a shared sum copied and scaled in one pass)."""
        self._rescaled_copy = rescale is not None
        for bucket in self.buckets:
            if bucket.shared:
                self._claim(bucket)
                if rescale is None:
                    bucket.buffer.flat.copy_(bucket.result.flat)
                else:
                    torch.mul(bucket.result.flat, rescale, out=bucket.buffer.flat)
                for p, view in zip(bucket.params, bucket.buffer.views):
                    p.grad = view
            elif rescale is not None:
                bucket.buffer.flat.mul_(rescale)
        self._in_window = False

    def reduced(self) -> list[torch.Tensor]:
        """After :meth:`finish`: each bucket's flat reduced gradients, where ``p.grad`` reads them
        (alone: the parameters' own gradients)."""
        if self.alone:
            return [grad for p in self.params if (grad := p.grad) is not None]
        return [bucket.result.flat if self._in_window else bucket.buffer.flat for bucket in self.buckets]

    def _take_unreported(self, bucket: Bucket) -> None:
        """Gradients backward did not bring this step into the bucket: None counts as zero."""
        if self._withheld:
            return
        reported, generation = self._reported, self._generation
        first = self._slot[id(bucket.params[0])]  # a bucket's parameters are numbered in a row
        for i, (p, view) in enumerate(zip(bucket.params, bucket.buffer.views), first):
            if reported[i] == generation:
                continue
            grad = p.grad
            if grad is view:
                continue
            if grad is None:
                self._claim(bucket)
                view.zero_()
                p.grad = view
            elif grad.data_ptr() != view.data_ptr():
                self._claim(bucket)
                view.copy_(grad)
                p.grad = view

    def rearm(self) -> None:
        """Expect the next step's backward: every bucket waits for all its gradients again.

        Node-shared buckets whose sums may be read in place: first wait until every local
        rank has stepped (collective over the node; :meth:`.shm.NodeSumReducer.release`).
        """
        if self._next and self._reduced is None:  # in flight
            raise RuntimeError("mpisolve: buckets rearmed while their reduction is in flight")
        if self._release is not None:
            self._release()
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
        self._next = 0
        self._generation += 1
        if self.passes > 1:
            self._arrivals = [0] * len(self._arrivals)
        self._reduced = None
        self._withheld = False
        self._refused = False
        self.backward_ran = False

    def close(self) -> None:
        """Remove the hooks and free the reducer's MPI resources (complete a step in flight first).

        Gradients held in node-shared windows are copied out before the windows go.
        """
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.node is not None:
            for p in self.params:
                if p.grad is not None:
                    p.grad = p.grad.clone()
        self.reducer.close()
