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

**Weights.** Where the two sides of a pair stand for unlike numbers of nonzero inputs, m
under ``a`` and n under ``b`` (an uneven tree when P is not a power of two; a zero input:
a rank under ``join()``, a tensor no loss reached), the rule's halves become the sides'
shares: ``a``'s coefficient is ``1 - m/(m+n) a.b/|a|^2`` and ``b``'s
``1 - n/(m+n) a.b/|b|^2``. Parallel inputs then give the mean of the nonzero ones at every
P, as the plain rule does only for P a power of two and no zeros (at P = 3 it would weigh
g2 twice as much as g0 and g1); orthogonal inputs still give their sum, identical ones the
input. The counts travel per tensor with each level's statistics (one rank a side adds its
operand's code, :mod:`mpisolve.kernels.adasum`), so every rank of a block weighs alike.

**Communication.** An odd rank among the first 2r sends its buffer to its even
neighbour, which combines the pair locally and joins the k "active" ranks. These run
VHDD: at level L = 1, 2, ..., k/2 each keeps half of its current piece, swaps the other
half with the active rank at distance L, computes per-tensor partial [dot, |a|^2, |b|^2]
on its half, sums them (with the sides' codes) over the block of 2L active ranks (a small
allreduce on a sub-communicator made once), and combines its half; the halves are then gathered back
in reverse, and the pair partners get the result. Data volume is that of a ring
allreduce (plus, for P not a power of two, the fold in and out, as MPICH's own
allreduce does for such P).

Every reduction is a fixed sequence of stages with persistent MPI requests, set up once
per fused buffer; :class:`Adasum` drives several at once without blocking, so buckets
reduce while backward runs (:class:`AdasumReducer`).

**Engines.** Where the communicator's torch.distributed engine sends a piece (gloo: host
tensors; NCCL: device tensors; :mod:`.engine`), the fold's and the levels' messages are
its sends and receives (:class:`~.engine.TorchMessage`), else MPI's; the statistics'
allreduces stay MPI's. NCCL matches a pair's messages in posting order, so under it a pair
posts an exchange's send and receive in one order, and reductions run one at a time.

**Ranks on one node.** Where node-shared memory applies (:mod:`.shm`), a step whose
partner shares the node passes no message: each rank works in its slot of a node-shared
window and reads the partner's piece in place, waiting on its progress counter
(:class:`AdasumReduction`'s node path); steps between nodes and the statistics' sums stay
on MPI, so the result is the message path's, bit for bit.

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

from ..kernels.adasum import combined_codes, segment_combine, segment_stats, warm_up_cpu
from .buckets import Bucket
from .communicator import Communicator, Posting, mpi_buffer
from .device import Stager
from .engine import TorchMessage
from .shm import CACHE_LINE, NodeCounters, NodeGroup, node_group, padded, takes
from .windows import free_window, shared_window


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
        #: The node-shared path's node (None: every step passes messages, as without it).
        self.group: NodeGroup | None = node_group(comm)
        self._local_ranks: dict[int, int] = {}
        if self.group is not None:
            world, node = comm.comm.Get_group(), self.group.node.Get_group()
            ranks = world.Translate_ranks(list(range(size)), node)
            world.Free()
            node.Free()
            self._local_ranks = {w: r for w, r in enumerate(ranks) if r != MPI.UNDEFINED}
        # Node-path progress phases within a round (see AdasumReduction): VHDD levels of every active rank.
        self.depth = self.active.bit_length() - 1
        self.done_phase = 3 + 2 * self.depth
        self.stride = self.done_phase + 1

    @staticmethod
    def _world_rank(virtual: int, extra: int) -> int:
        return 2 * virtual if virtual < extra else virtual + extra

    def local_rank(self, world: int) -> int | None:
        """``world``'s rank on this rank's node where the node path applies, else None (another node, or none)."""
        return self._local_ranks.get(world)

    def partners(self) -> list[int]:
        """World ranks this rank combines with: its fold partner, then its level partners."""
        fold = [] if self.fold_partner is None else [self.fold_partner]
        return fold + [partner for _, partner, _, _ in self.levels]

    #: Phases of the node path: this rank's input is in its slot; the fold has combined.
    ARRIVED = 1
    FOLDED = 2

    @staticmethod
    def combined(index: int) -> int:
        """The phase at which the slot's kept piece of level ``index`` (0: L = 1) holds its combination."""
        return 3 + index

    def gathered(self, index: int) -> int:
        """The phase at which the slot's piece before level ``index``'s halving holds the result
        (``index == depth``: the deepest kept piece, combined)."""
        return 2 + 2 * self.depth - index


class _Operation(Protocol):
    """What a stage waits for: a persistent message, the statistics' allreduce, or (node path)
    a node partner's progress counter."""

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


class _NodeBuffers:
    """One reduction's node-shared memory: every local rank's working copy of the buffer and
    its progress counter (int64, a cache line each), in one ``MPI_Win_allocate_shared`` window.

    A counter (:class:`.shm.NodeCounters`) holds ``round * stride + phase``: monotonic, so a
    partner can wait for a phase of this round without a barrier.
    """

    def __init__(self, group: NodeGroup, numel: int, dtype: torch.dtype) -> None:
        self.comm = group.comm
        self.local_rank = group.local_rank
        ranks = group.local_size
        flags = ranks * CACHE_LINE
        #: The window's bytes on the node.
        self.nbytes = self.window_bytes(group, numel, dtype)
        self.win, memory = shared_window(group.comm, self.nbytes, flags, "node-shared Adasum buffers")
        #: Every local rank's progress counter.
        self.progress = NodeCounters(memory[:flags], group.local_rank)
        rows = memory[flags:].view(dtype).view(ranks, -1)
        #: Every local rank's slot: its working copy of the buffer.
        self.slots = [rows[r, :numel] for r in range(ranks)]

    @staticmethod
    def window_bytes(group: NodeGroup, numel: int, dtype: torch.dtype) -> int:
        """The bytes of the window for ``numel`` elements of ``dtype``: the counters, then a slot per local rank."""
        return group.local_size * (CACHE_LINE + padded(numel * dtype.itemsize))

    def free(self) -> None:
        free_window(self.comm, self.win)


class _Progress:
    """A stage's wait until a node-local partner's progress counter reaches ``phase`` of this
    round (``previous``: of the round before, which a first round does not wait for)."""

    def __init__(self, reduction: AdasumReduction, local_rank: int, phase: int, *, previous: bool = False) -> None:
        self.reduction = reduction
        self.local_rank = local_rank
        self.phase = phase
        self.previous = previous

    def start(self) -> None:
        """Nothing to post: the partner's counter is polled."""

    def test(self) -> bool:
        node = self.reduction.node
        assert node is not None  # only node-path reductions wait for a counter
        target = self.reduction.mark(self.phase, previous=self.previous)
        return target == 0 or node.progress.reached(target, rank=self.local_rank)

    def wait(self, what: str | None = None) -> None:
        """Nothing left after a true :meth:`test`."""

    def free(self) -> None:
        """Nothing held."""


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


@dataclass
class _PairStatistics:
    """A pair's per-segment statistics and its sides' codes, in one buffer a level's allreduce sums."""

    block: torch.Tensor
    #: (segments, 3): dot product and the two squared norms.
    stats: torch.Tensor
    #: (segments, 2): the lower and upper sides' codes (mpisolve.kernels.adasum: nonzero inputs under each).
    counts: torch.Tensor

    @classmethod
    def zeros(cls, segments: int, device: torch.device) -> _PairStatistics:
        block = torch.zeros(5 * segments, dtype=torch.float64, device=device)
        return cls(block, block[: 3 * segments].view(segments, 3), block[3 * segments :].view(segments, 2))


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

    **Node path** (where :func:`.shm.node_group` and :func:`.shm.takes` apply): the
    reduction works in this rank's slot of a node-shared window (``flat`` is copied in at
    the start and the result out at the end, so ``flat`` may be another tensor of the
    same size and dtype from one round to the next), and a step whose partner shares the
    node passes no message: the fold reads the partner's whole slot, a level reads the
    partner's half of it in place, a gather copies the partner's result straight from its
    slot. Each waits on the partner's progress counter, never on a barrier; steps whose
    partner is on another node, and every statistics' allreduce, stay on MPI. Same
    pairing, same operands, same statistics' sums: the result is bit for bit the one of
    the message path. Phases a rank publishes in a round (:class:`AdasumTopology`):
    ARRIVED (input in the slot), FOLDED, combined(j) per level, gathered(j) per level in
    reverse (its last one: the whole slot holds the result), done (it reads no other slot
    any more); a slot is written for the next round once its node partners are done.
    """

    topology: AdasumTopology
    flat: torch.Tensor
    numels: Sequence[int]
    tag: int = 0
    #: Node-shared slots made ahead (:meth:`Adasum.storage`), whose slot is ``flat`` itself.
    shared: _NodeBuffers | None = None
    #: Whether the reduction may make node-shared slots of its own where the node path applies (False:
    #: messages at every step, as where it does not apply; the same result).
    node_shared: bool = True
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
        self.round = 0
        #: Node-shared slots where the node path applies (None: every step passes messages).
        self.node: _NodeBuffers | None = self.shared
        if self.node is None and self.node_shared and topo.group is not None and n > 0 and takes(comm, flat):
            self.node = _NodeBuffers(topo.group, n, flat.dtype)
        #: The memory the reduction works in: this rank's slot on the node path, else ``flat``.
        self.buffer = flat if self.node is None else self.node.slots[self.node.local_rank]
        buffer = self.buffer
        #: Whether ``flat`` is the slot itself (nothing to copy in or out).
        self.in_place = buffer.data_ptr() == flat.data_ptr()
        # Staged: one host twin of the buffer, sliced for every message (None: MPI takes it directly).
        self._flat_twin = comm.host_twin(buffer)
        if topo.folded_out:
            partner = topo.fold_partner
            assert partner is not None  # a folded-out rank always has a fold partner
            if self.node is not None:
                self.stages.append(self._copy_in(topo.ARRIVED, (0, n)))
            local = self._local(partner)
            if local is None:
                self.stages += [
                    _Stage(f"fold: data to rank {partner}", [self._send(buffer, self._flat_twin, partner)]),
                    _Stage(f"fold: result from rank {partner}", [self._receive(buffer, self._flat_twin, partner)]),
                ]
                if self.node is not None:
                    self.stages.append(_Stage("copy out", [], self._copy_out))
            else:  # the result read straight from the partner's slot
                result = _Progress(self, local, topo.gathered(0))
                self.stages.append(_Stage(f"fold: result from rank {partner}", [result], self._copy_from(local)))
            return
        if device.type == "cpu" and (topo.fold_partner is not None or topo.levels):
            warm_up_cpu(flat.dtype)
        if self.node is not None:
            # This rank's first combine reads its own input from ``flat`` and writes the slot;
            # only the half its first level sends (read in place or sent from the slot) goes in first.
            if topo.fold_partner is not None:
                self.stages.append(self._copy_in(topo.ARRIVED, None))
            else:
                half = n // 2
                self.stages.append(self._copy_in(topo.FOLDED, (half, n) if topo.levels[0][2] else (0, half)))
        elif topo.group is not None:
            # A buffer off the node path (empty, or a dtype it does not take) beside node-path ones:
            # its statistics' allreduces keep the stage indices Adasum orders collectives by.
            self.stages.append(_Stage("node path not taken", []))
        scratch_len = n if topo.fold_partner is not None else (n - n // 2 if topo.levels else 0)
        self.scratch = torch.empty(scratch_len, dtype=flat.dtype, device=device)
        self._scratch_twin = comm.host_twin(self.scratch)
        #: The code (mpisolve.kernels.adasum) of this rank's operand per segment: how many nonzero inputs
        #: it stands for, after the fold or a level; kept only where this rank sends it at the next level.
        self._code = torch.zeros(segments, dtype=torch.float64, device=device)
        if topo.fold_partner is not None:
            stats = _PairStatistics.zeros(segments, device)  # two single inputs: their codes stay 0
            bounds = _bounds(edges, 0, n, device)
            local = self._local(topo.fold_partner)
            name = f"fold: data from rank {topo.fold_partner}"
            if local is None:
                recv = self._receive(self.scratch[:n], _slice(self._scratch_twin, 0, n), topo.fold_partner)
                combine = self._combiner(
                    0,
                    n,
                    True,
                    self.scratch[:n],
                    bounds,
                    stats,
                    bool(topo.levels),
                    local=True,
                    first=self.node is not None,
                )
                self.stages.append(_Stage(name, [recv], self._then(combine, topo.FOLDED)))
            else:
                assert self.node is not None  # a node-local partner exists only on the node path
                combine = self._combiner(
                    0,
                    n,
                    True,
                    self.node.slots[local],
                    bounds,
                    stats,
                    bool(topo.levels),
                    local=True,
                    first=self.node is not None,
                )
                arrived = _Progress(self, local, topo.ARRIVED)
                self.stages.append(_Stage(name, [arrived], self._then(combine, topo.FOLDED)))
        lo, hi = 0, n
        gathers: list[_Stage] = []
        for index, (level, partner, lower, sub) in enumerate(topo.levels):
            half = (hi - lo) // 2
            keep, send = ((lo, lo + half), (lo + half, hi)) if lower else ((lo + half, hi), (lo, lo + half))
            keep_len = keep[1] - keep[0]
            bounds = _bounds(edges, *keep, device)
            stats = _PairStatistics.zeros(segments, device)
            # One rank a side (the first of its L) sends its operand's code with the statistics; at the
            # first level, where no rank folded, every operand is a single input, coded 0.
            composite = index > 0 or topo.fold_partner is not None
            column = (0 if lower else 1) if composite and topo.virtual % level == 0 else None
            coded = index + 1 < len(topo.levels) and topo.virtual % (2 * level) == 0
            local = self._local(partner)
            first = self.node is not None and index == 0 and topo.fold_partner is None
            exchange_name = f"level {level} exchange with rank {partner}"
            gather_name = f"level {level} gather with rank {partner}"
            gathered = self._then(None, topo.gathered(index))
            if local is None:
                other = self.scratch[:keep_len]
                exchange = self._pair(
                    self._send(buffer[send[0] : send[1]], _slice(self._flat_twin, *send), partner),
                    self._receive(other, _slice(self._scratch_twin, 0, keep_len), partner),
                    partner,
                )
                gather = self._pair(
                    self._send(buffer[keep[0] : keep[1]], _slice(self._flat_twin, *keep), partner),
                    self._receive(buffer[send[0] : send[1]], _slice(self._flat_twin, *send), partner),
                    partner,
                )
                gathers.append(_Stage(gather_name, gather, gathered))
            else:  # the partner's piece read in place, its result copied from its slot
                assert self.node is not None  # a node-local partner exists only on the node path
                other = self.node.slots[local][keep[0] : keep[1]]
                ready = topo.combined(index - 1) if index > 0 else topo.FOLDED
                exchange = [_Progress(self, local, ready)]
                # No fold partner reads this slot's result: the last gather lands in ``flat`` itself.
                copy = self._then(self._copier(local, send, keep if first else None), topo.gathered(index))
                gathers.append(_Stage(gather_name, [_Progress(self, local, topo.gathered(index + 1))], copy))
            statistics = self._statistics(keep, lower, other, bounds, stats, first=first, summed=True, column=column)
            self.stages.append(_Stage(exchange_name, exchange, statistics))
            self.stages.append(
                _Stage(
                    f"level {level} allreduce of statistics over {sub.size} ranks",
                    [sub.persistent_allreduce(stats.block)],
                    self._then(
                        self._combiner(*keep, lower, other, bounds, stats, coded, first=first), topo.combined(index)
                    ),
                )
            )
            lo, hi = keep
        self.stages.extend(reversed(gathers))
        if topo.fold_partner is not None and self._local(topo.fold_partner) is None:
            to_partner = self._send(buffer, self._flat_twin, topo.fold_partner)
            self.stages.append(_Stage(f"fold: result to rank {topo.fold_partner}", [to_partner]))
        if self.node is not None:
            gathered_in_place = topo.fold_partner is None and self._local(topo.levels[0][1]) is not None
            self.stages.append(_Stage("copy out", [], self._done if gathered_in_place else self._copy_out))

    def _send(self, piece: torch.Tensor, twin: torch.Tensor | None, partner: int) -> _Operation:
        return self._message(piece, twin, partner, receive=False)

    def _receive(self, piece: torch.Tensor, twin: torch.Tensor | None, partner: int) -> _Operation:
        return self._message(piece, twin, partner, receive=True)

    def _message(self, piece: torch.Tensor, twin: torch.Tensor | None, partner: int, *, receive: bool) -> _Operation:
        """Through the communicator's engine where it sends ``piece`` (NCCL: device tensors; gloo: host
        ones), else through MPI (staged where the communicator stages it)."""
        comm = self.topology.comm
        if comm.engine_takes(piece) and comm.torch_group().takes_p2p(piece):
            return TorchMessage(comm.torch_group(), piece, partner, self.tag, comm.wait_for, receive=receive)
        return _Message(comm, Stager(piece, twin), partner, self.tag, receive=receive)

    def _pair(self, send: _Operation, receive: _Operation, partner: int) -> list[_Operation]:
        """An exchange's send and receive in the order this side posts them: the lower rank sends
        first, the higher receives first (an engine that matches a pair's messages by order, NCCL's,
        then never has both sides send first; MPI and gloo match by tag, in any order)."""
        return [send, receive] if self.topology.comm.rank < partner else [receive, send]

    # ------------------------------------------------------------- node path
    def _local(self, partner: int) -> int | None:
        """``partner``'s local rank when this reduction reads its slot (node path, same node), else None."""
        return None if self.node is None else self.topology.local_rank(partner)

    def mark(self, phase: int, *, previous: bool = False) -> int:
        """The progress value of ``phase`` in this round (``previous``: the round before; 0 before the first)."""
        round_ = self.round - 1 if previous else self.round
        return round_ * self.topology.stride + phase if round_ > 0 else 0

    def _publish(self, phase: int) -> None:
        assert self.node is not None
        self.node.progress.publish(self.mark(phase))

    def _then(self, work: Callable[[], None] | None, phase: int) -> Callable[[], None] | None:
        """``work``, then (on the node path) this rank's progress published as ``phase``."""
        if self.node is None:
            return work

        def then() -> None:
            if work is not None:
                work()
            self._publish(phase)

        return then

    def _copy_in(self, phase: int, region: tuple[int, int] | None) -> _Stage:
        """The node path's first stage: once no node partner reads this slot any more (its last
        round done), ``flat[region]`` is copied in (None: nothing) and ``phase`` published."""
        topo = self.topology
        readers = [r for r in map(self._local, topo.partners()) if r is not None]
        waits: list[_Operation] = [_Progress(self, r, topo.done_phase, previous=True) for r in readers]

        def copy_in() -> None:
            if region is not None and not self.in_place:
                self.buffer[region[0] : region[1]].copy_(self.flat[region[0] : region[1]])
            self._publish(phase)

        return _Stage("node-shared slot reuse", waits, copy_in)

    def _copy_out(self) -> None:
        if not self.in_place:
            self.flat.copy_(self.buffer)
        self._done()

    def _done(self) -> None:
        self._publish(self.topology.done_phase)

    def _copier(self, local: int, send: tuple[int, int], keep: tuple[int, int] | None) -> Callable[[], None]:
        """A gather from a node partner's slot: its piece ``send`` into this rank's slot, or (``keep``
        given: the last gather, no fold partner) into ``flat``, this rank's piece ``keep`` beside it."""
        assert self.node is not None
        source, target = self.node.slots[local][send[0] : send[1]], self.buffer[send[0] : send[1]]

        def copy() -> None:
            if keep is None:
                target.copy_(source)
            else:
                self.flat[send[0] : send[1]].copy_(source)
                if not self.in_place:
                    self.flat[keep[0] : keep[1]].copy_(self.buffer[keep[0] : keep[1]])

        return copy

    def _copy_from(self, local: int) -> Callable[[], None]:
        """A folded-out rank's end: the result copied from the partner's slot into ``flat``."""
        assert self.node is not None
        source = self.node.slots[local]

        def copy() -> None:
            self.flat.copy_(source)
            self._done()

        return copy

    # The pair (a, b) is always (lower side, upper side), so every rank of a block
    # accumulates the same [dot, |lower|^2, |upper|^2] and the sum is well defined.
    def _operands(
        self, lo: int, hi: int, lower: bool, other: torch.Tensor, first: bool
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """The pair at call time; ``first``: this rank's own piece still in ``flat`` (the node
        path's first combine, which writes it into the slot)."""
        own_buffer = self.buffer[lo:hi]

        def operands() -> tuple[torch.Tensor, torch.Tensor]:
            own = self.flat[lo:hi] if first else own_buffer
            return (own, other) if lower else (other, own)

        return operands

    def _statistics(
        self,
        keep: tuple[int, int],
        lower: bool,
        other: torch.Tensor,
        bounds: torch.Tensor,
        stats: _PairStatistics,
        first: bool = False,
        summed: bool = False,
        column: int | None = None,
    ) -> Callable[[], None]:
        """This rank's part of the pair's statistics; ``summed``: a level's, to be summed over its block,
        with this rank's operand's code in ``column`` of the codes (None: it sends none)."""
        operands = self._operands(*keep, lower, other, first)
        tensors = self._stats_tensors
        # The summed tail is left out: its row of statistics stays zero.
        end = int(bounds[tensors])

        def compute() -> None:
            a, b = operands()
            segment_stats(a[:end], b[:end], bounds[: tensors + 1], stats.stats[:tensors])
            if summed:
                stats.counts.zero_()
                if column is not None:
                    stats.counts[:, column].copy_(self._code)

        return compute

    def _combiner(
        self,
        lo: int,
        hi: int,
        lower: bool,
        other: torch.Tensor,
        bounds: torch.Tensor,
        stats: _PairStatistics,
        coded: bool,
        local: bool = False,
        first: bool = False,
    ) -> Callable[[], None]:
        """The combine of the pair's piece ``lo:hi`` into this rank's buffer; ``coded``: then its result's
        code too, which this rank sends at the next level (its side's first rank there)."""
        operands = self._operands(lo, hi, lower, other, first)
        out = self.buffer[lo:hi]
        statistics = self._statistics((lo, hi), lower, other, bounds, stats, first) if local else None

        def combine() -> None:
            if statistics is not None:  # the fold: whole tensors are here, no sum needed
                statistics()
            a, b = operands()
            segment_combine(a, b, bounds, stats.stats, stats.counts, out)
            if coded:
                combined_codes(stats.stats, stats.counts, self._code)

        return combine

    def writable(self) -> bool:
        """Whether no node partner still reads this rank's slot (every one done with this round)."""
        topo = self.topology
        readers = [r for r in map(self._local, topo.partners()) if r is not None]
        return all(_Progress(self, r, topo.done_phase).test() for r in readers)

    def wait_writable(self, what: str) -> None:
        """Before writing ``flat`` where it is the slot itself: wait (watchdogged) until :meth:`writable`."""
        if self.node is not None and self.round > 0:
            self.topology.comm.wait_for(self.writable, lambda: f"{what} (node progress {self.node_progress()})")

    def node_progress(self) -> list[int]:
        return [] if self.node is None else self.node.progress.tolist()

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
        self.round += 1

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

    @property
    def nbytes(self) -> int:
        """The bytes of its node-shared window (0: none)."""
        return 0 if self.node is None else self.node.nbytes

    def free(self) -> None:
        """Release the persistent requests and the node-shared window (collective over the node)."""
        for stage in self.stages:
            for operation in stage.operations:
                operation.free()
        self.stages = []
        if self.node is not None:
            self.node.free()
            self.node = None


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
        self._storage: dict[int, _NodeBuffers] = {}  # slot address -> its window, until a reduction takes it
        #: NCCL matches a pair's messages by the order they are posted, not by tag: a reduction then
        #: starts once every earlier one is done, so that every rank posts them in one order.
        self._one_at_a_time = comm.engine == "nccl"

    def storage(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A zeroed buffer of ``numel`` elements in this rank's slot of a new node-shared window, for a
        caller to keep its data in and reduce in place (no copy in or out), or None where the node
        path does not apply (collective over the node; every rank of it gets one or none)."""
        group = self.topology.group
        if group is None or numel < 1 or not takes(self.comm, torch.empty(0, dtype=dtype)):
            return None
        shared = _NodeBuffers(group, numel, dtype)
        slot = shared.slots[shared.local_rank]
        slot.zero_()
        self._storage[slot.data_ptr()] = shared
        return slot

    def window_bytes(self, flat: torch.Tensor) -> int | None:
        """The bytes of the node-shared window a reduction of ``flat`` makes (None where it makes none:
        the node path does not apply)."""
        group = self.topology.group
        if group is None or flat.numel() < 1 or not takes(self.comm, flat):
            return None
        return _NodeBuffers.window_bytes(group, flat.numel(), flat.dtype)

    def reduction(
        self, flat: torch.Tensor, numels: Sequence[int], tag: int = 0, *, node_shared: bool = True
    ) -> AdasumReduction:
        """A reusable in-place reduction of ``flat`` (tensors of ``numels``, then summed extras);
        where ``flat`` is a buffer of :meth:`storage`, the reduction works in it and owns its window.
        ``node_shared=False``: it makes no window of its own (messages at every step)."""
        if flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError("Adasum reduces flat contiguous buffers")
        shared = self._storage.pop(flat.data_ptr(), None)
        if shared is not None and shared.slots[shared.local_rank].numel() != flat.numel():
            raise ValueError("a node-shared Adasum buffer is reduced whole")
        # MPI guarantees tags < 32768.
        return AdasumReduction(self.topology, flat, list(numels), tag % 32768, shared, node_shared)

    def start(self, reduction: AdasumReduction) -> None:
        reduction.restart()
        self._inflight.append(reduction)
        self.progress()

    def progress(self) -> None:
        """Move every in-flight reduction along as far as it goes without waiting."""
        limit = None
        for reduction in self._inflight:
            reduction.advance(len(reduction.stages) if limit is None else limit)
            limit = (None if reduction.done else 0) if self._one_at_a_time else reduction.started
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

    @property
    def node_shared(self) -> bool:
        """Whether any bucket's reduction takes the node path (node-shared slots)."""
        return any(r.node is not None for r in self.reductions.values())

    def prepare(self, bucket: Bucket) -> None:
        # An alias of its own version counter: the reduction's writes are not a user's change of the gradients.
        self.reductions[bucket.index] = self.adasum.reduction(bucket.wire.data, bucket.buffer.numels, tag=bucket.index)

    def storage(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Node-shared storage for a bucket reduced in place where it applies (:meth:`Adasum.storage`)."""
        return self.adasum.storage(numel, dtype)

    def wait_writable(self, bucket: Bucket) -> None:
        """Before writing a bucket kept in node-shared storage: wait until no node partner reads it."""
        self.reductions[bucket.index].wait_writable(f"adasum of bucket {bucket.index}: node-shared slot reuse")

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
