"""Flat fused buffers, tensor views into them, and gradient buckets reduced during backward.

A :class:`FusedBuffer` lays tensors of one dtype end to end in one flat tensor and hands
out views, so that one MPI call moves them all and nothing is packed twice.
:class:`GradientBuckets` makes a model's gradients such views and starts each bucket's
nonblocking reduction from autograd hooks as soon as all of the bucket's gradients have
been accumulated, in a fixed bucket order every rank follows, so communication overlaps
the rest of the backward pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch

from .communicator import MPI_TYPES, Communicator, PersistentAllreduce
from .shm import NodeSumReducer, node_group, takes

#: float16 and bfloat16 have no MPI reduction type; they are reduced in float32.
HALF_DTYPES = (torch.float16, torch.bfloat16)


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` is reduced in over MPI."""
    if dtype in HALF_DTYPES:
        return torch.float32
    if dtype not in MPI_TYPES or not dtype.is_floating_point:
        raise TypeError(f"mpisolve reduces floating-point tensors only, got {dtype}")
    return dtype


class FusedBuffer:
    """Tensors of one dtype and device laid end to end; ``views[i]`` aliases tensor ``i``.

    ``extra`` adds that many trailing elements after the views (e.g. a sample count that
    rides along with the gradients). ``flat``: lay the views over this (zeroed) memory of
    at least that many elements instead of a new tensor (node-shared storage).
    """

    def __init__(
        self,
        shapes: Sequence[torch.Size],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        extra: int = 0,
        flat: torch.Tensor | None = None,
    ) -> None:
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [s.numel() for s in self.shapes]
        self.offsets: list[int] = []
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.numel = total
        if flat is None:
            flat = torch.zeros(total + extra, dtype=dtype, device=device)
        elif flat.dtype != dtype or flat.numel() < total + extra:
            raise ValueError(f"storage of {flat.numel()} {flat.dtype} cannot hold {total + extra} {dtype}")
        self.flat = flat[: total + extra]
        self.views = [self.flat[o : o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]
        self.extra = self.flat[total:]

    def pack(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``tensors`` into their places in the flat buffer.

        On the CPU, tensors of the buffer's dtype move in one fused byte copy
        (``mpisolve.kernels.fused``, faster than torch's copy on large buffers: ``bench kernels``,
        docs/studies/benchmarks.md); otherwise each tensor is copied (and cast) by torch.
        """
        if [t.numel() for t in tensors] != self.numels:
            raise ValueError("pack needs tensors of the sizes the buffer was laid out for")
        if self.flat.is_cpu and all(t.is_cpu and t.dtype == self.flat.dtype for t in tensors):
            from ..kernels.fused import pack

            pack([t.contiguous() for t in tensors], self.flat)
            return
        for view, t in zip(self.views, tensors):
            view.copy_(t)


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
    :class:`NodeSumReducer` giving the storage), whose sum is read in place from the window.
    """

    def __init__(
        self, index: int, params: list[torch.nn.Parameter], extra: int, node: NodeSumReducer | None = None
    ) -> None:
        self.index = index
        self.params = params
        dtype = params[0].dtype
        shapes = [p.shape for p in params]
        if node is None:
            self.buffer = FusedBuffer(shapes, dtype, params[0].device, extra=extra)
            wire = wire_dtype(dtype)
            # Half-precision gradients are reduced through a float32 twin of the buffer.
            self.wire = self.buffer.flat if wire == dtype else torch.zeros_like(self.buffer.flat, dtype=wire)
            self.result = self.buffer
        else:
            numel = sum(s.numel() for s in shapes) + extra
            self.buffer = FusedBuffer(shapes, dtype, extra=extra, flat=node.allocate(numel, dtype))
            self.wire = self.buffer.flat  # the node-shared kernel reads half precision as it is
            self.result = FusedBuffer(shapes, dtype, extra=extra, flat=node.result(index))
        self.pending = len(params)
        self.launched = False

    def to_wire(self) -> None:
        if self.wire is not self.buffer.flat:
            self.wire.copy_(self.buffer.flat)

    def from_wire(self, scale: float | None = None) -> None:
        """Bring the reduced wire buffer back into the gradients, scaled by ``scale``."""
        if scale is not None:
            self.wire.mul_(scale)
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


class SumReducer:
    """Sums each bucket with a persistent nonblocking allreduce."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.requests: dict[int, PersistentAllreduce] = {}
        self._inflight: list[PersistentAllreduce] = []

    def prepare(self, bucket: Bucket) -> None:
        self.requests[bucket.index] = self.comm.persistent_allreduce(bucket.wire, "sum")

    def start(self, bucket: Bucket) -> None:
        req = self.requests[bucket.index]
        req.start()
        self._inflight.append(req)

    def progress(self) -> None:
        if self._inflight:
            # Testing lets MPI move the in-flight buckets along while backward computes.
            self._inflight = [r for r in self._inflight if not r.test()]

    def finish(self, bucket: Bucket) -> None:
        self.requests[bucket.index].wait(f"gradient allreduce of bucket {bucket.index}")

    def close(self) -> None:
        for req in self.requests.values():
            req.free()
        self.requests.clear()
        self._inflight.clear()


class GradientBuckets:
    """A model's gradients as views into fused buckets, reduced while backward runs.

    Parameters are bucketed in reverse registration order (roughly the order backward
    produces their gradients). Each ``p.grad`` is made a view into its bucket, so
    autograd accumulates straight into the buffer MPI sends. When a bucket's last
    gradient arrives its reduction starts, but only after every earlier bucket's has,
    so all ranks start collectives in the same order. ``finish`` starts whatever backward
    did not (unused parameters), completes everything and applies ``scale``.

    With ``samples`` (a callable giving this rank's sample count so far, read when the
    first bucket starts), that bucket carries one extra element, the count, which the sum
    turns into the global count of the update at no extra message. ``scale``: a factor
    known up front (``1 / ranks`` for a mean), applied to every reduction.

    **Node-shared buckets**: with the default sum, CPU parameters and more than one rank
    per node (:func:`.shm.node_group`; off with ``Communicator(node_shm=False)`` or
    ``MPISOLVE_NODE_SHM=0``), each bucket lives in a node-shared window
    (:class:`.shm.NodeSumReducer`): backward writes this rank's slot, the node's ranks sum
    their shares as soon as all have written it (``scale`` fused into the sum), nodes
    exchange by MPI, and after ``finish`` each ``p.grad`` is a view of the sum in the
    window, read in place: the node's ranks share it, so nothing may write it. Before the
    next backward accumulates into a gradient, a hook points it back at this rank's slot
    (copying the sum there only when the gradient was not zeroed). ``shared_result=False``
    (for solvers that change gradients in place, as K-FAC's preconditioner does) copies
    the sum into the slot instead and leaves ``p.grad`` there.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        comm: Communicator,
        *,
        bucket_bytes: int,
        reducer: BucketReducer | None = None,
        samples: Callable[[], int] | None = None,
        scale: float | None = None,
        shared_result: bool = True,
    ) -> None:
        self.comm = comm
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no parameters that require gradients")
        ordered = self.params[::-1]
        self.scale = scale
        self.shared_result = shared_result
        group = node_group(comm) if reducer is None else None
        if group is not None and all(takes(p) for p in self.params):
            self.node: NodeSumReducer | None = NodeSumReducer(group, 1.0 if scale is None else scale)
            self.reducer: BucketReducer = self.node
        else:
            self.node = None
            self.reducer = reducer if reducer is not None else SumReducer(comm)
        plan = plan_buckets(ordered, bucket_bytes)
        # A half-precision slot would round the count: node-shared half buckets send it apart.
        self._count_rides = samples is not None and not (
            self.node is not None and ordered[plan[0][0]].dtype in HALF_DTYPES
        )
        self._local_count: int | None = None
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        self._view_of: dict[int, torch.Tensor] = {}
        for i, members in enumerate(plan):
            extra = 1 if (self._count_rides and i == 0) else 0
            bucket = Bucket(i, [ordered[j] for j in members], extra=extra, node=self.node)
            self.buckets.append(bucket)
            for p, view in zip(bucket.params, bucket.buffer.views):
                self._bucket_of[id(p)] = bucket
                self._view_of[id(p)] = view
                p.grad = view
            self.reducer.prepare(bucket)
        self.samples = samples
        self._next = 0  # the next bucket to start, in bucket order
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        #: Node-shared buckets whose slot no local rank still reads (free to write).
        self._writable = [True] * len(self.buckets)
        if self.node is not None:
            self._hooks += [p.register_hook(functools.partial(self._before_accumulate, p)) for p in self.params]

    # ------------------------------------------------------------------ hooks
    def _before_accumulate(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Node-shared buckets: make the slot writable and ``param.grad`` its view before autograd adds into it."""
        bucket = self._bucket_of[id(param)]
        self._claim(bucket)
        view = self._view_of[id(param)]
        if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)  # not zeroed since the step: the sum accumulates on
            param.grad = view

    def _claim(self, bucket: Bucket) -> None:
        if not self._writable[bucket.index]:
            assert self.node is not None
            self.node.wait_writable(bucket.index)
            self._writable[bucket.index] = True

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        bucket = self._bucket_of[id(param)]
        view = self._view_of[id(param)]
        if param.grad.data_ptr() != view.data_ptr():
            # The user set grads to None (optimizer.zero_grad()): bring the fresh gradient
            # into the bucket and make the grad a view again.
            view.copy_(param.grad)
            param.grad = view
        bucket.pending -= 1
        if bucket.pending == 0:
            self._start_ready()
        self.reducer.progress()

    def _start(self, bucket: Bucket) -> None:
        self._claim(bucket)  # a bucket backward did not touch (unused parameters)
        bucket.to_wire()
        if self.samples is not None and bucket.index == 0:
            if self._count_rides:
                # Written into the wire buffer: half-precision buckets travel in float32, which
                # holds any realistic count exactly, where bfloat16 would round it past 256.
                bucket.wire[-1] = self.samples()
            else:
                self._local_count = self.samples()
        self.reducer.start(bucket)
        bucket.launched = True

    def _start_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._start(self.buckets[self._next])
            self._next += 1

    # ------------------------------------------------------------------ steps
    def zero_(self) -> None:
        """Zero every gradient in place (one fill per bucket) and rearm the buckets."""
        for bucket in self.buckets:
            self._claim(bucket)
            bucket.buffer.flat.zero_()
            for p, view in zip(bucket.params, bucket.buffer.views):
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
        self.rearm()

    def rearm(self) -> None:
        """Expect a new backward pass: every bucket waits for all its gradients again."""
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.launched = False
        self._next = 0

    def finish(self, scale: float | None = None, local_samples: int | None = None) -> int:
        """Start what backward did not, complete every bucket and scale the gradients.

        Returns the global sample count: the one that rode with the first bucket, or, when
        ``local_samples`` is given (on every rank alike), the sum of those by one small
        allreduce. 0 without ``samples``. ``scale`` overrides the constructor's (not for
        node-shared buckets, whose sum is scaled as it is made).
        """
        if self.node is not None and scale is not None:
            raise ValueError(
                "node-shared gradient buckets are scaled as they are summed: give scale= when building them"
            )
        while self._next < len(self.buckets):
            self._start(self.buckets[self._next])
            self._next += 1
        for bucket in self.buckets:
            self.reducer.finish(bucket)
        samples = 0
        mine = local_samples if local_samples is not None else self._local_count
        if mine is not None:
            samples = int(self.comm.allreduce_(torch.tensor([float(mine)]), what="sample count").item())
            self._local_count = None
        elif self.samples is not None:
            count = self.buckets[0].result.flat[-1].item()
            samples = int(round(count / self.node.scale if self.node is not None else count))
        if self.node is None:
            for bucket in self.buckets:
                bucket.from_wire(self.scale if scale is None else scale)
            return samples
        for bucket in self.buckets:
            self._writable[bucket.index] = False  # local ranks may still be reading this round's slots
            if self.shared_result:
                for p, view in zip(bucket.params, bucket.result.views):
                    p.grad = view
            else:
                self._claim(bucket)
                bucket.buffer.flat.copy_(bucket.result.flat)
        return samples

    def reduced(self) -> list[torch.Tensor]:
        """The flat reduced gradients of every bucket (after ``finish``), e.g. to check them."""
        return [bucket.result.flat for bucket in self.buckets]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.reducer.close()
