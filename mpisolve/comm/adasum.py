"""Adasum over any number of ranks: vector-halving distance-doubling on fused buffers.

The pairwise rule, per tensor ``t`` (statistics in float64 whatever the dtype)::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

with a coefficient left at 1 when its squared norm is below sqrt(DBL_MIN).

**Order.** With P ranks, k the largest power of two <= P and r = P - k, the result is
the binary tree over adjacent ranks in which the first 2r ranks are paired at the
bottom: ranks (0, 1), (2, 3), ..., (2r-2, 2r-1) are combined first, and the r pair
results together with ranks 2r..P-1 (k operands, in rank order) form a complete binary
tree of adjacent pairs. For P a power of two this is ((g0+g1)+(g2+g3))+...; for P = 3
it is (g0+g1)+g2; for P = 6 it is ((g0+g1)+(g2+g3))+(g4+g5).

**Communication.** An odd rank among the first 2r sends its buffer to its even
neighbour, which combines the pair locally and joins the k "active" ranks. These run
VHDD: at level L = 1, 2, ..., k/2 each keeps half of its current piece, swaps the other
half with the active rank at distance L, computes per-tensor partial [dot, |a|^2, |b|^2]
on its half, sums them over the block of 2L active ranks (a small allreduce on a
sub-communicator made once), and combines its half; the halves are then gathered back
in reverse, and the pair partners get the result. Data volume is that of a ring
allreduce (plus, for P not a power of two, the fold in and out, as MPICH's own
allreduce does for such P).

Every reduction is a fixed sequence of stages with persistent MPI requests, set up once
per fused buffer; :class:`Adasum` drives several at once without blocking, so buckets
reduce while backward runs (:class:`AdasumReducer`).

**Device memory.** Every message goes through a :class:`~.device.Stager`, as collectives
do: where the communicator stages the buffer (MPI not CUDA-aware, or ``stage_all``),
sends and receives use slices of one host twin of the buffer and one of the scratch
space, copied to and from the device around each message; the statistics' allreduce is
staged by its own sub-communicator and its result brought back before the combine. The
kernels run where the buffer is (a GPU buffer: on torch's current stream), and MPI
starts a message only once the kernels that wrote it are done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from mpi4py import MPI

from ..kernels.adasum import segment_combine, segment_stats, warm_up_cpu
from .buckets import Bucket
from .communicator import Communicator, Posting, mpi_buffer
from .device import Stager


class AdasumTopology:
    """Who combines with whom on this rank: the fold of extra ranks and the VHDD levels.

    The level sub-communicators are named splits of ``comm``, made on first use and
    reused for every later reduction on that communicator.
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        size, rank = comm.size, comm.rank
        self.active = 1 << (size.bit_length() - 1)  # k: ranks that run VHDD
        extra = size - self.active
        #: The rank this one folds with before VHDD (None: no fold), and which side it is.
        self.fold_partner: int | None = None
        self.folded_out = False  # True: this rank hands its data to fold_partner and waits
        if rank < 2 * extra:
            self.fold_partner = rank + 1 if rank % 2 == 0 else rank - 1
            self.folded_out = rank % 2 == 1
        self.virtual = rank // 2 if rank < 2 * extra else rank - extra
        #: (L, partner world rank, lower side?, sub-communicator of the 2L block) per level.
        self.levels: list[tuple[int, int, bool, Communicator]] = []
        level = 1
        while level < self.active:
            color = None if self.folded_out else self.virtual // (2 * level)
            sub = comm.split(color, name=("adasum", level))
            if not self.folded_out:
                assert sub is not None  # a rank that is not folded out has a color at every level
                partner = self.virtual ^ level
                self.levels.append((level, self._world_rank(partner, extra), self.virtual & level == 0, sub))
            level *= 2

    @staticmethod
    def _world_rank(virtual: int, extra: int) -> int:
        return 2 * virtual if virtual < extra else virtual + extra


class _Operation(Protocol):
    """A persistent MPI operation of a stage: a message or the statistics' allreduce."""

    def start(self) -> None: ...

    def test(self) -> bool: ...

    def wait(self, what: str | None = None) -> None: ...

    def free(self) -> None: ...


class _Message:
    """A persistent send or receive of one slice of a buffer, through its stager.

    Started, it is posted once the slice is ready (the kernels that wrote it, or still
    read it, are done; a staged send's copy to host too); completed, a staged receive
    copies what arrived back into the slice.
    """

    def __init__(self, comm: Communicator, stager: Stager, partner: int, tag: int, *, receive: bool) -> None:
        self.comm = comm
        self.stager = stager
        self.receive = receive
        init = comm.comm.Recv_init if receive else comm.comm.Send_init
        self.request: MPI.Prequest = init(mpi_buffer(stager.memory), partner, tag)
        self.posting = Posting([stager], self._post)

    def _post(self) -> MPI.Request:
        self.request.Start()
        return self.request

    def start(self) -> None:
        self.stager.to_mpi(values=not self.receive)
        self.comm.start(self.posting)

    def test(self) -> bool:
        return self.comm.test(self.posting)

    def wait(self, what: str | None = None) -> None:
        self.comm.wait_posted([self.posting], what or ("receive" if self.receive else "send"))
        if self.receive:
            self.stager.from_mpi()

    def free(self) -> None:
        self.comm.unqueue(self.posting)
        self.request.Free()


@dataclass
class _Stage:
    """One step of a reduction: operations to start, then work once they complete.

    ``name`` says what the stage waits for, for the watchdog's message.
    """

    name: str
    operations: Sequence[_Operation]
    then: Callable[[], None] | None = None

    def start(self) -> None:
        for operation in self.operations:
            operation.start()

    def test(self) -> bool:
        return all(operation.test() for operation in self.operations)

    def complete(self) -> None:
        """After a true :meth:`test`: bring received data in, then do the stage's work."""
        for operation in self.operations:
            operation.wait(self.name)
        if self.then is not None:
            self.then()


def _slice(twin: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    return None if twin is None else twin[lo:hi]


def _bounds(edges: np.ndarray, lo: int, hi: int, device: torch.device) -> torch.Tensor:
    """Segment edges clipped to [lo, hi) and made relative to lo."""
    return torch.from_numpy(np.clip(edges - lo, 0, hi - lo)).to(device)


@dataclass
class AdasumReduction:
    """The in-place Adasum of one flat buffer whose segments are the tensors to combine.

    ``numels`` are the tensors' sizes, laid end to end from the buffer's start; elements
    after them (e.g. a sample count riding along) are summed, not combined. Built once
    per buffer: persistent requests, scratch space and statistics live as long as it.
    """

    topology: AdasumTopology
    flat: torch.Tensor
    numels: Sequence[int]
    tag: int = 0
    stages: list[_Stage] = field(init=False)
    started: int = field(init=False, default=0)
    finished: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        topo, flat = self.topology, self.flat
        comm = topo.comm
        n = flat.numel()
        numel = int(sum(self.numels))
        if numel > n:
            raise ValueError(f"the tensors ({numel} elements) do not fit the buffer ({n})")
        # Segment edges: every tensor, then the summed tail (its statistics stay zero, so
        # its coefficients are 1); statistics are computed over the tensors only.
        edges = np.concatenate(([0], np.cumsum(np.asarray(self.numels, dtype=np.int64)), [n])).astype(np.int64)
        segments = len(self.numels) + 1
        device = flat.device
        self._stats_tensors = segments - 1
        self.stages = []
        # Staged: one host twin of the buffer, sliced for every message (None: MPI takes it directly).
        self._flat_twin = comm.host_twin(flat)
        if topo.folded_out:
            partner = topo.fold_partner
            assert partner is not None  # a folded-out rank always has a fold partner
            self.stages += [
                _Stage(f"fold: data to rank {partner}", [self._send(flat, self._flat_twin, partner)]),
                _Stage(f"fold: result from rank {partner}", [self._receive(flat, self._flat_twin, partner)]),
            ]
            return
        if device.type == "cpu" and (topo.fold_partner is not None or topo.levels):
            warm_up_cpu(flat.dtype)
        scratch_len = n if topo.fold_partner is not None else (n - n // 2 if topo.levels else 0)
        self.scratch = torch.empty(scratch_len, dtype=flat.dtype, device=device)
        self._scratch_twin = comm.host_twin(self.scratch)
        if topo.fold_partner is not None:
            stats = torch.zeros(segments, 3, dtype=torch.float64, device=device)
            bounds = _bounds(edges, 0, n, device)
            recv = self._receive(self.scratch[:n], _slice(self._scratch_twin, 0, n), topo.fold_partner)
            combine = self._combiner(0, n, True, bounds, stats, local=True)
            self.stages.append(_Stage(f"fold: data from rank {topo.fold_partner}", [recv], combine))
        lo, hi = 0, n
        gathers: list[_Stage] = []
        for level, partner, lower, sub in topo.levels:
            half = (hi - lo) // 2
            keep, send = ((lo, lo + half), (lo + half, hi)) if lower else ((lo + half, hi), (lo, lo + half))
            keep_len = keep[1] - keep[0]
            bounds = _bounds(edges, *keep, device)
            stats = torch.zeros(segments, 3, dtype=torch.float64, device=device)
            exchange = [
                self._send(flat[send[0] : send[1]], _slice(self._flat_twin, *send), partner),
                self._receive(self.scratch[:keep_len], _slice(self._scratch_twin, 0, keep_len), partner),
            ]
            statistics = self._statistics(keep, lower, bounds, stats)
            self.stages.append(_Stage(f"level {level} exchange with rank {partner}", exchange, statistics))
            self.stages.append(
                _Stage(
                    f"level {level} allreduce of statistics over {sub.size} ranks",
                    [sub.persistent_allreduce(stats)],
                    self._combiner(*keep, lower, bounds, stats),
                )
            )
            gather = [
                self._send(flat[keep[0] : keep[1]], _slice(self._flat_twin, *keep), partner),
                self._receive(flat[send[0] : send[1]], _slice(self._flat_twin, *send), partner),
            ]
            gathers.append(_Stage(f"level {level} gather with rank {partner}", gather))
            lo, hi = keep
        self.stages.extend(reversed(gathers))
        if topo.fold_partner is not None:
            result = self._send(flat, self._flat_twin, topo.fold_partner)
            self.stages.append(_Stage(f"fold: result to rank {topo.fold_partner}", [result]))

    def _send(self, piece: torch.Tensor, twin: torch.Tensor | None, partner: int) -> _Message:
        return _Message(self.topology.comm, Stager(piece, twin), partner, self.tag, receive=False)

    def _receive(self, piece: torch.Tensor, twin: torch.Tensor | None, partner: int) -> _Message:
        return _Message(self.topology.comm, Stager(piece, twin), partner, self.tag, receive=True)

    # The pair (a, b) is always (lower side, upper side), so every rank of a block
    # accumulates the same [dot, |lower|^2, |upper|^2] and the sum is well defined.
    def _operands(self, lo: int, hi: int, lower: bool) -> tuple[torch.Tensor, torch.Tensor]:
        own, other = self.flat[lo:hi], self.scratch[: hi - lo]
        return (own, other) if lower else (other, own)

    def _statistics(
        self, keep: tuple[int, int], lower: bool, bounds: torch.Tensor, stats: torch.Tensor
    ) -> Callable[[], None]:
        a, b = self._operands(*keep, lower)
        tensors = self._stats_tensors
        # The summed tail is left out: its row of statistics stays zero.
        end = int(bounds[tensors])

        def compute() -> None:
            segment_stats(a[:end], b[:end], bounds[: tensors + 1], stats[:tensors])

        return compute

    def _combiner(
        self, lo: int, hi: int, lower: bool, bounds: torch.Tensor, stats: torch.Tensor, local: bool = False
    ) -> Callable[[], None]:
        a, b = self._operands(lo, hi, lower)
        out = self.flat[lo:hi]
        statistics = self._statistics((lo, hi), lower, bounds, stats) if local else None

        def combine() -> None:
            if statistics is not None:  # the fold: whole tensors are here, no sum needed
                statistics()
            segment_combine(a, b, bounds, stats, out)

        return combine

    # ------------------------------------------------------------- driving
    @property
    def done(self) -> bool:
        return self.finished == len(self.stages)

    @property
    def stage_in_flight(self) -> str | None:
        """The name of the stage started and not yet complete, if any."""
        return self.stages[self.finished].name if self.started > self.finished else None

    def restart(self) -> None:
        if self.started != self.finished:
            raise RuntimeError("an Adasum reduction was restarted while in flight")
        self.started = self.finished = 0

    def advance(self, limit: int) -> bool:
        """Complete what has arrived and start stages up to index ``limit``; True when done."""
        while True:
            if self.started > self.finished:
                stage = self.stages[self.finished]
                if not stage.test():
                    return False
                stage.complete()
                self.finished += 1
            if self.done:
                return True
            if self.started >= limit:
                return False
            self.stages[self.started].start()
            self.started += 1

    def free(self) -> None:
        for stage in self.stages:
            for operation in stage.operations:
                operation.free()
        self.stages = []


class Adasum:
    """Drives Adasum reductions on one communicator, several in flight at once.

    Reductions are started in one order on every rank; a reduction starts a stage only
    after every earlier one has started it, so collectives on each sub-communicator are
    started in the same order everywhere.
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.topology = AdasumTopology(comm)
        self._inflight: list[AdasumReduction] = []

    def reduction(self, flat: torch.Tensor, numels: Sequence[int], tag: int = 0) -> AdasumReduction:
        """A reusable in-place reduction of ``flat`` (tensors of ``numels``, then summed extras)."""
        if flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError("Adasum reduces flat contiguous buffers")
        return AdasumReduction(self.topology, flat, list(numels), tag % 32768)  # MPI guarantees tags < 32768

    def start(self, reduction: AdasumReduction) -> None:
        reduction.restart()
        self._inflight.append(reduction)
        self.progress()

    def progress(self) -> None:
        """Move every in-flight reduction along as far as it goes without waiting."""
        limit = None
        for reduction in self._inflight:
            reduction.advance(len(reduction.stages) if limit is None else limit)
            limit = reduction.started
        self._inflight = [r for r in self._inflight if not r.done]

    def finish(self, reduction: AdasumReduction, what: str = "adasum") -> None:
        """Complete ``reduction`` (and whatever started before it) through the watchdogged
        wait, working on any in-flight reduction whose data has arrived meanwhile. A
        timeout names the stage the reduction is stuck at (or the earlier reduction's
        stage that holds it back)."""

        def done() -> bool:
            self.progress()
            return reduction.done

        def where() -> str:
            if reduction.stage_in_flight is not None:
                return f"{what} ({reduction.stage_in_flight})"
            ahead = next((r for r in self._inflight if r.stage_in_flight is not None), None)
            return what if ahead is None else f"{what} (behind reduction {ahead.tag}: {ahead.stage_in_flight})"

        self.comm.wait_for(done, where)


class AdasumReducer:
    """A :class:`~mpisolve.comm.buckets.BucketReducer` that Adasum-combines each bucket.

    Every parameter of the bucket is its own tensor; the bucket's trailing extra
    elements (the sample count) are summed.
    """

    def __init__(self, comm: Communicator) -> None:
        self.adasum = Adasum(comm)
        self.reductions: dict[int, AdasumReduction] = {}

    def prepare(self, bucket: Bucket) -> None:
        self.reductions[bucket.index] = self.adasum.reduction(bucket.wire, bucket.buffer.numels, tag=bucket.index)

    def start(self, bucket: Bucket) -> None:
        self.adasum.start(self.reductions[bucket.index])

    def progress(self) -> None:
        self.adasum.progress()

    def finish(self, bucket: Bucket) -> None:
        self.adasum.finish(self.reductions[bucket.index], f"adasum of bucket {bucket.index}")

    def close(self) -> None:
        for reduction in self.reductions.values():
            reduction.free()
        self.reductions.clear()
