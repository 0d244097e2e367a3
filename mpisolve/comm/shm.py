"""Node-aware allreduce: ranks that share memory sum in a node-shared window, nodes talk by MPI.

A :class:`NodeGroup` is a communicator's view of its node: the node's ranks
(``MPI_COMM_TYPE_SHARED``) and, when there are several nodes, the ranks that have the
same local rank on every node (the "cross" communicator: local rank ``i`` of every node
talks to the others' local rank ``i``, so every rank's network link carries a slice).

A :class:`NodeAllreduce` is one persistent sum of ``numel`` elements. Its memory is one
``MPI_Win_allocate_shared`` window holding, for each local rank, a *slot* (the rank's
input; two on the latency path), its *counters*, and on the bandwidth path the *result*
(on the latency path across nodes the node leader's *published* sum and tally, with a
counter of their own).
A round:

1. ``start``: this rank's input is final: it bumps its ``arrived`` counter (on the
   latency path after copying the input in, and the last local rank to arrive sums at once).
2. Once every local rank has arrived (their counters, no barrier), either
   - **bandwidth path**: the input is the slot itself (a bucket's gradients are written
     there by backward). This rank sums the slots over its own share of the elements into
     the node-shared result (:func:`mpisolve.kernels.slots.slot_sum`), allreduces that
     share over the cross communicator when there are several nodes, and bumps its
     ``done`` counter; the round is complete when every local rank is done, and the whole
     result is read in place by every local rank. A slot may be written again once every
     local rank is done (:meth:`NodeAllreduce.wait_writable`; completion implies it); or
   - **latency path** (at most :data:`LATENCY_MAX_BYTES`): the input is this rank's own
     memory, copied at ``start`` into one of two slots, alternating by round. This rank
     sums that round's slots over the whole range back into its input, in place. One
     counter-synchronised pass: no rank waits for another to finish reading, since a rank
     that completed round ``n + 1`` saw every local rank arrive at it, so all have finished
     reading round ``n``'s slots, the ones round ``n + 2`` writes. With several nodes only
     local rank 0, the node's leader, sums; it allreduces the node's sum (and the tally)
     over the cross communicator, with the other nodes' leaders, and publishes both in the
     window behind a counter of its own, which the node's other ranks wait for and copy
     from: one exchange per node, and the same bits on every rank of a node. The leader writes that
     row again only once every local rank arrived at the next round, so after each copied.

**Completion order.** A bandwidth-path round completes once every local rank has summed
its own share, which a rank does only while it tests or waits on that round (or on the
group's earlier ones, for the inter-node part). So every rank must complete the node-shared
sums it started in one order, the same on every rank (any order, as long as it is the
same; or all of them in one wait, as :func:`sum_kept` does): a rank waiting on sum B while
another waits on sum A, each needing the other's share, wait until the watchdog. MPI's
persistent sums need no such care. The callers keep it: gradient buckets finish in bucket
order, K-FAC's factor groups in start order, ABS-SGD has one round in flight, and
``mpisolve.allreduce`` waits on all of its sums at once.

Counters are int64 in their own cache lines (:class:`NodeCounters`), published with
release order and read with acquire order. Every wait goes through
:meth:`Communicator.wait_for`, with its watchdog; across nodes one that never sleeps between
polls, since MPI moves the exchange between nodes only while the rank calls into it, and
where the communicator allows it (:meth:`Communicator.waits_in_mpi`) a rank that exchanges
polls only until its exchange is posted, then waits in ``MPI_Wait``. The exchanges are MPI
persistent allreduces made with the sum, posted in the
order rounds were started (:meth:`NodeGroup.post_ready`), so every rank posts them in the
same order.

The node-aware path applies to CPU floating-point buffers that MPI takes directly (not
staged: ``MPISOLVE_STAGE=1`` emulates a GPU's path) on a communicator with more than one
rank per node and the same number on every node; it is off with ``MPISOLVE_NODE_SHM=0`` or
``Communicator(node_shm=False)``. Otherwise callers use the plain MPI path
(:func:`persistent_sum` makes that choice).

**By size.** Below a crossover (:attr:`NodeGroup.min_bytes`: by layout, one node or several,
from the measurements of docs/studies/node-aware.md, or ``MPISOLVE_NODE_SHM_MIN_BYTES``) a
sum takes flat MPI, as MPI libraries pick an algorithm by size: across nodes one
``MPI_Allreduce`` on the whole communicator costs less there than the node-shared round and
the exchange after it. ``mpisolve.allreduce`` of one tensor has a crossover of its own
(:attr:`NodeGroup.one_shot_min_bytes`: its node-shared round carries the check of the ranks'
calls too, where MPI's path would need a message of its own for it). The crossovers
are agreed when the group is made (the largest any rank asks for), so ranks summing the same
bytes take the same path (:func:`node_path`).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, cast

import torch
from mpi4py import MPI

from ..kernels import counters
from ..kernels.slots import SlotRound, arrival, host_rows, publication, published_copy, round_sum
from .communicator import Communicator, PersistentAllreduce
from .engine import InFlight
from .windows import CACHE_LINE, free_window, shard_bounds, shared_window

if TYPE_CHECKING:
    from .buckets import Bucket

#: Buffers of at most this many bytes take the latency path (docs/studies/node-aware.md).
LATENCY_MAX_BYTES = 64 * 1024

#: The smallest reusable sum (a gradient bucket, a solver's sum), in bytes, that goes through
#: node-shared memory, by layout (one node, several nodes); smaller ones take flat MPI, which is
#: faster there: the crossovers of docs/studies/node-aware.md. ``MPISOLVE_NODE_SHM_MIN_BYTES``
#: sets it, and :data:`ONE_SHOT_MIN_BYTES`, on every layout.
NODE_MIN_BYTES = {False: 0, True: 1024 * 1024}
#: The same for ``mpisolve.allreduce`` of one tensor (:mod:`.onetensor`; below it: one MPI call): its
#: node-shared sum, flag and all in one round, was the faster at every size and layout measured.
ONE_SHOT_MIN_BYTES = 0
MIN_BYTES_ENV = "MPISOLVE_NODE_SHM_MIN_BYTES"
#: The node-shared memory, in bytes on a node, that one cache of kept windows (:class:`KeptWindows`: a
#: communicator's ``mpisolve.allreduce`` of lists, of one tensor, of Adasum) may hold; a call whose window
#: alone is larger takes MPI's path. ``MPISOLVE_NODE_SHM_KEEP_BYTES`` sets it.
KEEP_BYTES = 1 << 30
KEEP_BYTES_ENV = "MPISOLVE_NODE_SHM_KEEP_BYTES"

#: How many more times a wait checks the local ranks' counters in compiled code, between two
#: polls of its watchdogged loop, under the "spin" wait policy (a few microseconds to tens).
SPIN_POLLS = 1000
#: The same under the "yield" policy, giving the core away between checks (``sched_yield``): a
#: local rank's turn on a shared core comes sooner than through a poll of the loop in Python.
YIELD_POLLS = 32

#: Element types a node-shared sum takes; half precision is summed in float32.
NODE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

FLAG_STRIDE = CACHE_LINE // 8  # int64 counters, one per cache line

K = TypeVar("K", bound=Hashable)
W = TypeVar("W", bound="Windowed")

_GROUPS: weakref.WeakKeyDictionary[Communicator, NodeGroup | None] = weakref.WeakKeyDictionary()


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to whole cache lines (a window's regions never share one)."""
    return -(-nbytes // CACHE_LINE) * CACHE_LINE


class NodeCounters:
    """One int64 counter per local rank, each in its own cache line of a node-shared window.

    A rank publishes a value (:meth:`publish`) after what it wrote before; :meth:`reached`
    checks counters, and what is read after a true answer is what was written before they
    were set: release and acquire order (:mod:`mpisolve.kernels.counters`), the memory
    barrier ``MPI_Win_sync`` gives load/store access in MPI's unified model, without a
    call into MPI. ``memory``: the counters' ``local_size * CACHE_LINE`` bytes of a
    node-shared window, zeroed.
    """

    def __init__(self, memory: torch.Tensor, local_rank: int) -> None:
        self.local_rank = local_rank
        #: The counters, as the kernels of :mod:`mpisolve.kernels.counters` take them.
        self.values = memory.view(torch.int64).numpy()[::FLAG_STRIDE]

    def publish(self, value: int) -> None:
        """Set this rank's counter to ``value``."""
        counters.publish(self.values, self.local_rank, value)

    def reached(self, value: int, rank: int | None = None) -> bool:
        """Whether every local rank's counter (``rank``'s alone, if given) has reached ``value``."""
        if rank is None:
            return bool(counters.reached(self.values, value))
        return bool(counters.reached_one(self.values, rank, value))

    def tolist(self) -> list[int]:
        return [int(v) for v in self.values]


class NodeGroup:
    """A communicator's node split and cross-node split, shared by all its node-shared sums.

    Build through :func:`node_group` (collective on ``comm``), which returns None where the
    node-aware path does not apply.
    """

    def __init__(self, comm: Communicator, *, min_bytes: int, one_shot_min_bytes: int, keep_bytes: int) -> None:
        self.comm = comm
        self.node = cast(MPI.Intracomm, comm.node)  # Split_type gives an intracommunicator
        self.local_rank = comm.local_rank
        self.local_size = comm.local_size
        self.nodes = comm.nodes
        #: Ranks with this rank's local rank on every node (None on one node).
        self.cross: Communicator | None = None
        if self.nodes > 1:
            self.cross = comm.split(self.local_rank, name=("mpisolve.shm", "cross"))
        #: Rounds started whose inter-node collective is not posted yet, in start order.
        self.unposted: list[NodeAllreduce] = []
        self.lock = threading.RLock()  # a progress thread may drive rounds beside the main thread
        #: Sums smaller than this many bytes take flat MPI (:func:`node_path`; agreed by :func:`node_group`,
        #: the same on every rank).
        self.min_bytes = min_bytes
        #: The same for ``mpisolve.allreduce`` of one tensor (:mod:`.onetensor`).
        self.one_shot_min_bytes = one_shot_min_bytes
        #: The windows' bytes each cache of kept windows on this group may hold (:class:`KeptWindows`).
        self.keep_bytes = keep_bytes
        #: The node-shared sums kept for one-shot callers (``mpisolve.allreduce`` of a list).
        self.kept = KeptSums(self)
        comm.on_free(self.free)

    def free(self) -> None:
        """Release the windows kept for one-shot callers (collective; run by ``comm.free()``)."""
        self.kept.free()
        _GROUPS.pop(self.comm, None)

    def post_ready(self) -> None:
        """Post the inter-node collectives of rounds whose node part is done, strictly in start order.

        Every rank starts rounds in the same order, so every rank posts the collectives on
        the cross communicator in the same order; an earlier round still waiting for its
        node's ranks holds the later ones back, and is driven from here.
        """
        while self.unposted:
            head = self.unposted[0]
            head.reduce_if_ready()
            if head.stage != "reduced":
                return
            head.post()
            self.unposted.pop(0)


#: How many windows a :class:`KeptWindows` keeps (one-shot sums by size and dtype, Adasum's reductions by layout).
ONE_SHOT_KEPT = 8


class Windowed(Protocol):
    """What holds a node-shared window: its bytes on the node, and its collective release."""

    @property
    def nbytes(self) -> int: ...

    def free(self) -> None: ...


class KeptWindows(Generic[K, W]):
    """What holds node-shared windows, kept by key for callers that make one a call at a time: at most
    ``count`` (:data:`ONE_SHOT_KEPT`), whose windows hold at most ``keep_bytes`` together (a group's
    :attr:`~NodeGroup.keep_bytes`), the least recently asked for freed first (collective: every rank asks
    for the same keys in the same order, so keeps and frees alike). A window past the bound alone is not
    to be made (:meth:`fits`)."""

    def __init__(self, keep_bytes: int, count: int = ONE_SHOT_KEPT) -> None:
        self.keep_bytes = keep_bytes
        self.count = count
        self.by_key: dict[K, W] = {}
        #: The kept windows' bytes on the node.
        self.nbytes = 0

    def fits(self, nbytes: int) -> bool:
        """Whether windows of ``nbytes`` in all can be kept at once."""
        return nbytes <= self.keep_bytes

    def get(self, wanted: Sequence[tuple[K, int]], make: Callable[[K], W]) -> list[W]:
        """The kept ones of these distinct keys, each given with its window's bytes (which together
        :meth:`fits`): made by ``make`` (collectively) where none is kept, after freeing the least
        recently asked for others as the bounds require."""
        keys = [key for key, _ in wanted]
        missing = [nbytes for key, nbytes in wanted if key not in self.by_key]
        others = [key for key in self.by_key if key not in keys]
        while others and (len(self.by_key) + len(missing) > self.count or self.nbytes + sum(missing) > self.keep_bytes):
            kept = self.by_key.pop(others.pop(0))
            self.nbytes -= kept.nbytes
            kept.free()
        for key in keys:
            if key in self.by_key:
                self.by_key[key] = self.by_key.pop(key)  # the most recently asked for last
            else:
                made = self.by_key[key] = make(key)
                self.nbytes += made.nbytes
        return [self.by_key[key] for key in keys]

    def forget(self, kept: W) -> None:
        """Stop keeping ``kept`` without releasing it (a failed call's: MPI may still use its window)."""
        self.by_key = {key: other for key, other in self.by_key.items() if other is not kept}
        self.nbytes = sum(other.nbytes for other in self.by_key.values())

    def free(self) -> None:
        """Release every kept window (collective)."""
        for kept in self.by_key.values():
            kept.free()
        self.by_key.clear()
        self.nbytes = 0


class KeptSums(KeptWindows[tuple[int, torch.dtype], "NodeAllreduce"]):
    """Node-shared sums kept by element count and dtype, for callers that sum a buffer at a time."""

    def __init__(self, group: NodeGroup) -> None:
        super().__init__(group.keep_bytes)
        self.group = group

    def fits_sums(self, sizes: Sequence[tuple[int, torch.dtype]]) -> bool:
        """Whether sums of these element counts and dtypes can be kept at once."""
        return self.fits(sum(WindowLayout.of(self.group, *size).total for size in sizes))

    def sums(self, sizes: Sequence[tuple[int, torch.dtype]]) -> list[NodeAllreduce]:
        """The kept sums of these distinct element counts and dtypes, which :meth:`fits_sums`."""
        wanted = [(size, WindowLayout.of(self.group, *size).total) for size in sizes]
        return self.get(wanted, lambda size: NodeAllreduce(self.group, *size))


STAGE_CHOICE = "staging every tensor (MPISOLVE_STAGE, Communicator(stage_all=...))"


def node_group(comm: Communicator) -> NodeGroup | None:
    """``comm``'s :class:`NodeGroup`, or None where the node-aware path does not apply (collective once).

    The ranks' choices that decide which path a sum takes (``node_shm``, ``stage_all``) must
    agree: where they differ, ``ValueError`` on every rank (else ranks on different paths
    would wait for each other until the watchdog).
    """
    if comm in _GROUPS:
        return _GROUPS[comm]
    mine = (
        comm.local_size,
        comm.node_shm,
        comm.stage_all,
        os.environ.get(MIN_BYTES_ENV),
        os.environ.get(KEEP_BYTES_ENV),
    )
    views = comm.allgather_object(mine) if comm.size > 1 else [mine]
    # Every rank reads every rank's settings, so a bad one is refused on every rank, naming it.
    asked = {name: [_byte_count(name, view[i], rank) for rank, view in enumerate(views)] for i, name in _BYTE_SETTINGS}
    for i, choice in ((1, "node-shared sums (MPISOLVE_NODE_SHM, Communicator(node_shm=...))"), (2, STAGE_CHOICE)):
        on = [rank for rank, view in enumerate(views) if view[i]]
        if 0 < len(on) < len(views):
            raise ValueError(
                f"mpisolve: the ranks disagree on {choice}: on at rank(s) {','.join(map(str, on))}, off at the "
                "others. It decides which path every sum takes: set it alike on every rank"
            )
    sizes = [view[0] for view in views]
    # The gloo engine takes every reusable sum (it is how that engine is tested without a GPU).
    applies = comm.node_shm and comm.engine != "gloo" and comm.local_size > 1 and min(sizes) == max(sizes)
    group = None
    if applies:
        crossovers = [value for value in asked[MIN_BYTES_ENV] if value is not None]
        caps = [value for value in asked[KEEP_BYTES_ENV] if value is not None]
        # The largest crossover any rank asks for, the smallest cap: every rank holds the same, so takes the same path.
        group = NodeGroup(
            comm,
            min_bytes=max(crossovers) if crossovers else NODE_MIN_BYTES[comm.nodes > 1],
            one_shot_min_bytes=max(crossovers) if crossovers else ONE_SHOT_MIN_BYTES,
            keep_bytes=min(caps) if caps else KEEP_BYTES,
        )
    _GROUPS[comm] = group
    return group


#: The byte counts the environment sets, by their place in :func:`node_group`'s gathered settings.
_BYTE_SETTINGS = ((3, MIN_BYTES_ENV), (4, KEEP_BYTES_ENV))


def _byte_count(name: str, text: str | None, rank: int) -> int | None:
    """The byte count ``text`` (rank ``rank``'s setting of the environment variable ``name``) asks for:
    :data:`MIN_BYTES_ENV`'s crossover, :data:`KEEP_BYTES_ENV`'s cap; None where it is unset (the default)."""
    text = (text or "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"mpisolve: {name} must be a byte count >= 0; rank {rank} has {text!r}")
    return value


def node_path(group: NodeGroup | None, nbytes: int) -> bool:
    """Whether a sum of ``nbytes`` goes through node-shared memory: a group, and at least its crossover.

    ``group.min_bytes`` is the same on every rank, so ranks summing alike take one path."""
    return group is not None and nbytes >= group.min_bytes


def takes(comm: Communicator, tensor: torch.Tensor) -> bool:
    """Whether a node-shared sum can reduce ``tensor``: a contiguous CPU float tensor ``comm`` does not stage."""
    return tensor.is_contiguous() and takes_layout(comm, tensor.dtype, tensor.device)


def takes_layout(comm: Communicator, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a node-shared sum can reduce contiguous tensors of ``dtype`` on ``device``."""
    return device.type == "cpu" and dtype in NODE_DTYPES and not comm.stage_all


@dataclass(frozen=True)
class WindowLayout:
    """Where a :class:`NodeAllreduce`'s regions lie in its window, in bytes: the counters, each local
    rank's slots (two on the latency path, alternating by round) and tally rows, then the result (the
    bandwidth path's, or across nodes the latency path's published sum and tally)."""

    latency: bool
    leader_only: bool
    copies: int
    row: int
    tally_row: int
    counters_bytes: int
    flags_bytes: int
    slots_end: int
    tally_end: int
    result_bytes: int

    @property
    def total(self) -> int:
        """The window's bytes on the node."""
        return self.tally_end + self.result_bytes

    @classmethod
    def of(cls, group: NodeGroup, numel: int, dtype: torch.dtype, tally: int = 0) -> WindowLayout:
        """The layout of a sum of ``numel`` elements of ``dtype`` (and ``tally`` float64 ones) on ``group``."""
        ranks = group.local_size
        latency = numel * dtype.itemsize <= LATENCY_MAX_BYTES
        leader_only = latency and group.cross is not None
        copies = 2 if latency else 1
        row = padded(numel * dtype.itemsize)
        tally_row = padded(tally * 8)
        counters_bytes = ranks * CACHE_LINE
        second_counters = not latency or leader_only  # "done" (bandwidth path) or "published"
        if leader_only:
            result_bytes = row + tally_row
        else:
            half = dtype in (torch.float16, torch.bfloat16)
            result_bytes = 0 if latency else row + (padded(numel * 4) if half else 0)
        flags_bytes = (2 if second_counters else 1) * counters_bytes
        slots_end = flags_bytes + ranks * copies * row
        tally_end = slots_end + ranks * copies * tally_row
        return cls(
            latency,
            leader_only,
            copies,
            row,
            tally_row,
            counters_bytes,
            flags_bytes,
            slots_end,
            tally_end,
            result_bytes,
        )


class NodeAllreduce:
    """One persistent node-aware sum of ``numel`` elements of ``dtype`` (collective to build and free).

    ``input``: where this rank writes its input before :meth:`start` (on the bandwidth
    path its slot in the window, writable once :meth:`writable`; on the latency path its
    own memory, copied in at ``start``). ``result``: the sum, valid from completion until
    the next round is started (on the bandwidth path shared by the node's ranks: read it,
    never write it; on the latency path ``input`` itself, summed in place). ``scale``
    multiplies every result.

    ``tally``: float64 elements summed in the same round, unscaled and exact whatever
    ``dtype`` and ``scale`` (a step's sample count beside its first gradient bucket, at
    no round of its own): this rank writes ``tally_input`` before :meth:`start` and every
    rank reads the whole sum in its own ``tally_result`` (on the latency path the same
    tensor, summed in place). ``storage``: on the latency path, the tensor (contiguous,
    ``numel`` elements of ``dtype``) to be the input and the result instead of memory of
    the operation's own, so a caller's tensor is summed in place with no copy of its own;
    unused on the bandwidth path.

    Rounds of several sums must be completed in the same order on every rank (the module's
    "Completion order"), unlike MPI's.
    """

    def __init__(
        self,
        group: NodeGroup,
        numel: int,
        dtype: torch.dtype,
        *,
        scale: float = 1.0,
        tally: int = 0,
        storage: torch.Tensor | None = None,
    ) -> None:
        if dtype not in NODE_DTYPES:
            raise TypeError(f"a node-shared sum takes {', '.join(map(str, NODE_DTYPES))}; got {dtype}")
        if numel < 1:
            raise ValueError(f"numel must be >= 1, got {numel}")
        if tally < 0:
            raise ValueError(f"tally must be >= 0, got {tally}")
        self.group = group
        self.comm = group.comm
        self.numel = numel
        self.dtype = dtype
        self.scale = float(scale)
        self.half = dtype in (torch.float16, torch.bfloat16)
        itemsize = dtype.itemsize
        ranks = group.local_size
        layout = WindowLayout.of(group, numel, dtype, tally)
        self.latency = layout.latency
        #: Whether a round ends with an exchange between nodes (which its waits must keep moving).
        self.across_nodes = group.cross is not None
        #: Whether only the node's leader (local rank 0) sums and exchanges with the other nodes and
        #: publishes the whole sum, which the node's other ranks copy: the latency path across nodes.
        self.leader_only = layout.leader_only
        #: Whether this rank sums the node's slots (and, across nodes, exchanges its share).
        self.sums = not self.leader_only or group.local_rank == 0
        self._copies = copies = layout.copies
        row, tally_row = layout.row, layout.tally_row
        counters_bytes, flags_bytes = layout.counters_bytes, layout.flags_bytes
        slots_end, tally_end = layout.slots_end, layout.tally_end
        second_counters = flags_bytes > counters_bytes
        #: The window's bytes (on the node, all local ranks' parts together).
        self.nbytes = layout.total
        self.win, memory = shared_window(group.comm, self.nbytes, flags_bytes, "node-shared window")
        self._arrived = NodeCounters(memory[:counters_bytes], group.local_rank)
        second = NodeCounters(memory[counters_bytes:flags_bytes], group.local_rank) if second_counters else None
        #: The bandwidth path's "done" counters; on the latency path across nodes the leader's "published" one.
        self._done = None if self.latency else second
        self._published = second if self.leader_only else None
        self._me = group.local_rank
        # Slots by copy, then local rank: one copy's rows are one (ranks, m) matrix for the kernel.
        slots = memory[flags_bytes:slots_end].view(dtype).view(copies, ranks, -1)
        tally_rows = memory[slots_end:tally_end].view(torch.float64).view(copies, ranks, tally_row // 8)
        if self.latency:
            if storage is not None and (
                storage.dtype != dtype or storage.numel() != numel or not takes(group.comm, storage)
            ):
                raise ValueError(f"storage must be a contiguous CPU tensor of {numel} {dtype}")
            self.input = self.result = torch.zeros(numel, dtype=dtype) if storage is None else storage.view(-1)
            self.tally_input = self.tally_result = torch.zeros(tally, dtype=torch.float64)
            acc = torch.zeros(numel, dtype=torch.float32) if self.half else self.result
            self.share = (0, numel)
        else:
            self.input = slots[0, self._me, :numel]
            self.tally_input = tally_rows[0, self._me, :tally]
            self.tally_result = torch.zeros(tally, dtype=torch.float64)
            self.result = memory[tally_end : tally_end + numel * itemsize].view(dtype)
            half_acc = memory[tally_end + row : tally_end + row + numel * 4]
            acc = half_acc.view(torch.float32) if self.half else self.result
            self.share = shard_bounds(numel, ranks, "sharded", itemsize)[self._me]
        lo, hi = self.share
        # Aliases of their own version counters: the round's writes are no change of a caller's input
        # (gradient buckets check theirs, :class:`.buckets.GradientBuckets`).
        self._acc_share = acc[lo:hi].data
        self._result_share = self.result[lo:hi].data
        #: This rank's exchange between nodes (where it sums): MPI's persistent sums of its share and the tally.
        self._exchange: list[PersistentAllreduce] = []
        if group.cross is not None and self.sums:
            self._exchange.append(group.cross.persistent_allreduce(self._acc_share))
            if tally:
                self._exchange.append(group.cross.persistent_allreduce(self.tally_result))
        # Each copy's round, its kernels checked once: the sum, once every local rank has arrived,
        # of this rank's share of the slots and of the whole tally; on the latency path also the
        # round's start (the copy in of raw bytes, the arrival, and one try at the sum where this
        # rank sums).
        scale = self.scale if group.cross is None else 1.0  # across nodes: scaled once the nodes' sums are in
        yielding = self.comm.wait_policy == "yield"
        rounds = [
            SlotRound(
                self._arrived.values,
                host_rows(slots[c]),
                lo,
                hi,
                acc.numpy(),
                tally_rows[c].numpy(),
                self.tally_result.numpy(),
                scale,
                brain=dtype == torch.bfloat16,
                yielding=yielding,
            )
            for c in range(copies)
        ]
        self._sums = [round_sum(r) for r in rounds]
        self._arrivals = (
            [
                arrival(
                    host_rows(self.input),
                    host_rows(slots[c, self._me, :numel]),
                    self.tally_input.numpy(),
                    tally_rows[c, self._me, :tally].numpy(),
                    self._me,
                    r,
                    sum_at_arrival=self.sums,
                )
                for c, r in enumerate(rounds)
            ]
            if self.latency
            else []
        )
        # The latency path across nodes: the leader publishes the whole sum and tally, the others copy them.
        self._publish: Callable[[int], object] | None = None
        self._take: Callable[[int, int], bool] | None = None
        if self.leader_only:
            assert self._published is not None
            published = memory[tally_end : tally_end + numel * itemsize].view(dtype)
            published_tally = memory[tally_end + row : tally_end + row + tally * 8].view(torch.float64)
            if self.sums:
                self._publish = publication(
                    host_rows(self.result),
                    host_rows(published),
                    self.tally_result.numpy(),
                    published_tally.numpy(),
                    self._published.values,
                    self._me,
                )
            else:
                self._take = published_copy(
                    self._published.values[:1],
                    host_rows(published),
                    host_rows(self.result),
                    published_tally.numpy(),
                    self.tally_result.numpy(),
                    yielding=yielding,
                )
        self._polls = YIELD_POLLS if yielding else SPIN_POLLS
        self._probe = self.comm.comm.Iprobe
        self._seq = 0
        #: idle -> arrived -> reduced -> (internode ->) published (bandwidth path) -> idle; a latency
        #: round's start goes straight to reduced (and on one node to idle) when this rank arrives last;
        #: across nodes the leader's other local ranks go idle -> awaiting (its published sum) -> idle.
        self.stage = "idle"

    # ----------------------------------------------------------------- round
    def start(self) -> None:
        """This rank's input is final: take part in a new round (local; never blocks)."""
        with self.group.lock:
            if self.stage != "idle":
                raise RuntimeError("a node-shared sum was started again before its round completed")
            self._seq += 1
            if self.latency:  # copied in and arrived; the last local rank to arrive sums at once
                summed = self._arrivals[self._seq % self._copies](self._seq)
            else:
                self._arrived.publish(self._seq)
                summed = False
            if not self.sums:
                self.stage = "awaiting"
            else:
                self.stage = "reduced" if summed else "arrived"
                if self.group.cross is not None:
                    self.group.unposted.append(self)
            self._advance(0)

    def test(self, polls: int = 0) -> bool:
        """Drive the round as far as it can go now (checking the arrivals up to ``polls`` more
        times); True once this rank's result is complete."""
        if self.stage == "idle":
            return True
        with self.group.lock:
            return self._advance(polls)

    def poll(self) -> bool:
        """:meth:`test` for a wait: it checks the local ranks' counters up to :data:`SPIN_POLLS` more
        times in compiled code under the "spin" wait policy, :data:`YIELD_POLLS` under "yield". Where
        the round is not complete, it also enters MPI's progress engine (a probe): the round itself
        calls MPI only for an exchange between nodes, and this rank's other started MPI operations
        must move while it waits, as MPI's own waits move them (a nonblocking barrier posted before,
        which the ranks still to arrive here must get through first)."""
        if self.test(self._polls):
            return True
        self._probe(MPI.ANY_SOURCE, MPI.ANY_TAG)
        return False

    def wait(self, what: str | None = None) -> None:
        """Complete the round. Where the communicator allows it (:meth:`.Communicator.waits_in_mpi`), a rank
        that exchanges with the other nodes polls only until its exchange is posted, then waits in MPI's own
        wait, which hands a shared core to the ranks it waits for sooner than a poll; past the timeout its
        watchdog thread aborts the job (:meth:`.Communicator.blocking`), where a polled wait raises
        :class:`~mpisolve.errors.CommTimeout`, as for MPI's own sums waited in ``MPI_Wait``."""

        if not self._exchange and self.poll():  # on one node a small round is often complete by now
            return

        def where() -> str:
            return f"{what or 'node-shared allreduce'} ({self.where()})"

        if self._exchange and self.comm.waits_in_mpi():
            self.comm.wait_for(self._posted_or_done, where, transfers=True)
            # Held through MPI_Wait: a thread driving the group meanwhile waits (a progress thread drives it
            # only for abs-sgd, whose rounds register interrupts, so that its waits never block in MPI).
            with self.group.lock:
                if self.stage == "internode":
                    for request in self._exchange:
                        request.wait(what or "node-shared allreduce", in_mpi=True)
                    self._exchanged()
            if self.stage == "idle":
                return
        self.comm.wait_for(self.poll, where, transfers=self.across_nodes)

    def _posted_or_done(self) -> bool:
        return self.poll() or self.stage == "internode"

    def writable(self) -> bool:
        """Whether ``input`` may be written for the next round (on the bandwidth path: no local rank still reads it)."""
        return self._done is None or self._done.reached(self._seq)

    def wait_writable(self, what: str = "node-shared slot reuse") -> None:
        """Wait until :meth:`writable` (before writing ``input`` for the next round)."""
        self.comm.wait_for(self.writable, lambda: f"{what} ({self.where()})")

    def where(self) -> str:
        done = "" if self._done is None else f", done {self._done.tolist()}"
        if self._published is not None:
            done = f", the leader published round {self._published.tolist()[0]}"
        return f"round {self._seq}, stage {self.stage}; local ranks arrived {self._arrived.tolist()}{done}"

    def reduce_if_ready(self, polls: int = 0) -> None:
        """Once every local rank has arrived (checked up to ``polls`` more times): sum the slots
        over this rank's share (stage "reduced")."""
        if self.stage == "arrived" and self._sums[self._seq % self._copies](self._seq, polls):
            self.stage = "reduced"

    def post(self) -> None:
        """Start the inter-node sums of this share and the tally (in start order: :meth:`NodeGroup.post_ready`)."""
        for request in self._exchange:
            request.start()
        self.stage = "internode"

    def _advance(self, polls: int) -> bool:
        if self.stage == "awaiting":
            assert self._take is not None
            self.group.post_ready()  # rounds started earlier wait for no one to post their exchanges
            if self._take(self._seq, polls):
                self.stage = "idle"
            return self.stage == "idle"
        self.reduce_if_ready(polls)
        if self.stage == "reduced":
            if self.group.cross is None:
                self._finish_share()
            else:
                self.group.post_ready()
        if self.stage == "internode":
            if not all(request.test() for request in self._exchange):  # one by one, as Communicator.wait
                return False
            self._exchanged()
        if self.stage == "published":
            assert self._done is not None  # the bandwidth path's stage
            if not self._done.reached(self._seq):
                return False
            self.stage = "idle"
        return self.stage == "idle"

    def _exchanged(self) -> None:
        """This rank's exchange between nodes is complete: the sum scaled, this rank's share done."""
        if self.scale != 1.0:
            self._acc_share.mul_(self.scale)
        self._finish_share()

    def _finish_share(self) -> None:
        if self.half:
            self._result_share.copy_(self._acc_share)  # rounded to half once, from the float32 sum
        if self._publish is not None:
            self._publish(self._seq)
        if self._done is None:
            self.stage = "idle"
        else:
            self._done.publish(self._seq)
            self.stage = "published"

    def free(self) -> None:
        """Release the exchange's requests and the window (collective over the node). A round in flight is
        completed first (on every rank alike: MPI frees no started request, and its ranks' exchanges meet)."""
        if self.stage != "idle":
            self.wait("node-shared allreduce, completed before it is freed")
        for request in self._exchange:
            request.free()
        free_window(self.comm, self.win)


class NodePersistentAllreduce:
    """:class:`PersistentAllreduce`'s interface over a :class:`NodeAllreduce`, for a contiguous CPU tensor.

    On the latency path the tensor is the operation's storage, summed in place; on the
    bandwidth path it is copied into this rank's slot at ``start`` and the sum back into it
    at ``wait``. Either way the tensor is the operation's until it completes, as MPI's.
    """

    kind = "node-shared allreduce"

    def __init__(self, group: NodeGroup, tensor: torch.Tensor) -> None:
        self.comm = group.comm
        self.tensor = tensor
        self._flat = tensor.view(-1)
        self.op = NodeAllreduce(group, tensor.numel(), tensor.dtype, storage=self._flat)
        self._via_slot = self.op.input is not self._flat  # the bandwidth path: copied in and out
        self._unread = False  # a round completed whose sum is not in the tensor yet
        self._joined = True  # this round's input is in the operation's and the round started

    def start(self) -> None:
        """Start a round (never blocks: while a local rank still reads the slot, the copy in waits for a test)."""
        self._unread, self._joined = self._via_slot, False
        self._join()

    def _join(self) -> None:
        if not self._joined and self.op.writable():
            if self._via_slot:
                self.op.input.copy_(self._flat)
            self.op.start()
            self._joined = True

    def test(self) -> bool:
        self._join()
        return self._joined and self.op.test()

    def _joins(self) -> bool:
        self._join()
        return self._joined

    def wait(self, what: str | None = None) -> None:
        """Complete the round and bring its sum into the tensor (once: as MPI's wait, a no-op after that)."""
        if not self._joined:
            self.comm.wait_for(self._joins, lambda: f"{what or self.kind}: slot reuse ({self.op.where()})")
        self.op.wait(what or self.kind)
        if self._unread:
            self._flat.copy_(self.op.result)
            self._unread = False

    def free(self) -> None:
        self.op.free()


def kept_sums(
    comm: Communicator, buffers: Sequence[tuple[int, torch.dtype, torch.device]]
) -> list[NodeAllreduce] | None:
    """Node-shared sums for buffers of these sizes, dtypes and devices, their inputs writable; None
    where the node-aware path does not apply (then nothing is kept).

    The caller writes each input, then :func:`sum_kept` sums them. One window per size and
    dtype is kept for the next call (:attr:`NodeGroup.kept`).
    """
    group = node_group(comm)
    if group is None or not all(takes_layout(comm, dtype, device) for _, dtype, device in buffers):
        return None
    if any(numel == 0 for numel, _, _ in buffers):
        return None  # an empty buffer: MPI's path, which sums zero elements
    if not node_path(group, sum(numel * dtype.itemsize for numel, dtype, _ in buffers)):
        return None  # a small call: flat MPI's path is faster
    sizes = [(numel, dtype) for numel, dtype, _ in buffers]
    if len(set(sizes)) < len(sizes):
        return None  # two buffers alike in one call: MPI's path (one window each would be kept)
    if not group.kept.fits_sums(sizes):
        return None  # windows larger than the node-shared memory kept sums may hold: MPI's path
    ops = group.kept.sums(sizes)
    for op in ops:
        op.wait_writable()
    return ops


def sum_kept(comm: Communicator, ops: Sequence[NodeAllreduce], what: str) -> None:
    """Start every sum of :func:`kept_sums` (their inputs written) and complete them all."""
    for op in ops:
        op.start()
    comm.wait_for(lambda: all([op.poll() for op in ops]), what, transfers=any(op.across_nodes for op in ops))


class NodeRelease:
    """The node's ranks agreeing that none of them still reads a round's shared results.

    One int64 counter per local rank, each in its own cache line, in a window of its own:
    :meth:`release` bumps this rank's and waits (watchdogged) until every local rank's
    has reached it. Node-local: the other nodes have their own windows.
    """

    def __init__(self, group: NodeGroup) -> None:
        self.comm = group.comm
        nbytes = group.local_size * CACHE_LINE
        self.win, memory = shared_window(group.comm, nbytes, nbytes, "node-shared release counters")
        self._counters = NodeCounters(memory, group.local_rank)
        self._seq = 0

    def release(self, what: str) -> None:
        """This rank is done with the round; return once every local rank is."""
        self._seq += 1
        self._counters.publish(self._seq)
        seq, counters = self._seq, self._counters
        self.comm.wait_for(lambda: counters.reached(seq), lambda: f"{what} (released {counters.tolist()}, {seq})")

    def free(self) -> None:
        free_window(self.comm, self.win)


class NodeSumReducer:
    """Gradient buckets summed in node-shared memory (a ``BucketReducer`` that also holds their storage).

    :meth:`allocate` gives a bucket its flat storage: the input of a
    :class:`NodeAllreduce`, which backward writes directly; ``start``, ``progress`` and
    ``finish`` drive the rounds in bucket order (a bucket is reduced as soon as every local
    rank has written it, while backward goes on); the sum, scaled by ``scale``, is in
    :meth:`result` (shared by the node's ranks on the bandwidth path: read it in place,
    never write it; on the latency path the bucket's own storage). The step's ``tally``
    (``tally`` float64 elements: counts the sum must hold exactly whatever the buckets'
    dtype and ``scale``) rides in the first bucket's round, unscaled (:attr:`tally_input`,
    :attr:`tally_result`). :meth:`release` ends a step whose shared results were read in
    place: no rank writes them before every local rank has stepped.
    """

    def __init__(self, group: NodeGroup, scale: float, tally: int) -> None:
        self.group = group
        self.scale = scale
        self.tally = tally
        self.ops: list[NodeAllreduce] = []
        self._numels: list[int] = []  # each bucket's elements (its op has one more where it has none)
        self._inflight = InFlight()
        self._release = NodeRelease(group)
        #: Whether some bucket's sum is shared by the node's ranks (the bandwidth path).
        self._shared = False

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Storage for the next bucket (collective): its round's input, zeroed; the first round carries the tally.

        An empty bucket (a parameter of no elements alone in it) still has its round (the
        tally may ride in it): one element of padding, zero, that nobody writes."""
        op = NodeAllreduce(self.group, max(numel, 1), dtype, scale=self.scale, tally=0 if self.ops else self.tally)
        op.input.zero_()
        op.tally_input.zero_()
        self.ops.append(op)
        self._numels.append(numel)
        self._shared = self._shared or not op.latency
        return op.input[:numel]

    @property
    def tally_input(self) -> torch.Tensor:
        """This rank's tally, written before the first bucket starts."""
        return self.ops[0].tally_input

    @property
    def tally_result(self) -> torch.Tensor:
        """The summed tally, once the first bucket's round is complete."""
        return self.ops[0].tally_result

    def result(self, index: int) -> torch.Tensor:
        """Where bucket ``index``'s sum lies: the window's shared sum (bandwidth path), else its input, in place."""
        return self.ops[index].result[: self._numels[index]]

    def shared(self, index: int) -> bool:
        """Whether bucket ``index``'s sum is shared by the node's ranks (read in place, written by none)."""
        return not self.ops[index].latency

    def wait_writable(self, index: int) -> None:
        """Wait until bucket ``index``'s input may be written (the first bucket's: and its tally)."""
        self.ops[index].wait_writable(f"gradient bucket {index} slot reuse")

    def prepare(self, bucket: Bucket) -> None:
        """Nothing: the bucket's round was set up by :meth:`allocate`."""

    def start(self, bucket: Bucket) -> None:
        self._inflight.start(self.ops[bucket.index])

    def progress(self) -> None:
        self._inflight.progress()

    def finish(self, bucket: Bucket) -> None:
        op = self.ops[bucket.index]
        if not op.test():  # tested first: the message is made only for a wait
            op.wait(f"node-shared gradient sum of bucket {bucket.index}")
        if bucket.index == len(self.ops) - 1:  # buckets finish in order: the step's last
            self._inflight.clear()

    def release(self) -> None:
        """The step that read the shared sums is over on this rank; wait for the node's other ranks.

        Only bandwidth-path sums are shared: where every bucket takes the latency path, each
        rank's result is its own and the step ends without waiting.
        """
        if self._shared:
            self._release.release("node-shared gradient release")

    def close(self) -> None:
        for op in self.ops:
            op.free()
        self._release.free()
        self.ops.clear()
        self._inflight.clear()
