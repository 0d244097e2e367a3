"""Shared vectors in MPI windows: the center variable and shared parameters of the async solvers.

A :class:`SharedVector` is one flat vector that every rank reads and updates one-sidedly,
without the others taking part. Its elements are sharded over the ranks (rank r owns a
contiguous, cache-line aligned slice), so no rank's memory or lock is a hot spot;
``layout="server"`` puts it all on rank 0 instead, to compare.

Two paths, chosen by where the ranks are:

- ``"shared"``: every rank is on one node (the communicator's shared-memory split says
  so). The window is ``MPI_Win_allocate_shared``; every rank maps the whole vector and
  loads and stores it directly, as torch tensors over the window memory.
- ``"internode"``: ranks on several nodes, or ``force_internode=True`` (to test this path
  on one machine). The window is ``MPI_Win_allocate``; updates are passive-target
  ``MPI_Raccumulate(SUM)`` and reads ``MPI_Rget_accumulate(NO_OP)`` (a plain Get racing an
  Accumulate is undefined in MPI), in chunks of ``chunk_bytes``.
- ``"device"``: ``device=`` names where the vector lives: torch allocates each shard
  there and ``MPI_Win_create`` exposes it; the one-sided operations are the inter-node
  path's, with their origin buffers on that device too, and wait for the kernels that
  use those buffers before MPI touches them. For GPU memory this needs an MPI whose RMA
  takes device memory (CUDA-aware; Open MPI with UCX, for one). On the CPU it is the
  same path on memory torch allocated, which is how it is tested.

Every other path keeps the vector in host memory: the caller gives :meth:`read` and
:meth:`update`'s function host tensors (a GPU model meets the vector through a pinned
host twin of its parameters; see the elastic solvers).

Two modes, chosen by the solver:

- ``locked=False`` (wild): one shared lock epoch (``MPI_Win_lock_all``) for the window's
  life; nobody excludes anybody. On the shared path :meth:`update` runs on the window
  memory itself (Hogwild: concurrent read-modify-writes may overwrite each other); on the
  inter-node path it reads, applies the function to a copy and accumulates the difference
  (element-wise atomic).
- ``locked=True``: :meth:`update` holds an exclusive lock on each shard while it reads
  and writes that shard, and :meth:`read` a shared one, so the exchange is atomic per
  shard, as a parameter server serving one worker at a time would make it. On the shared
  path the locks are words in node-shared memory (:class:`ShardLocks`, taken with an
  atomic compare-and-swap); elsewhere they are ``MPI_Win_lock`` on the shard's owner.

:meth:`accumulate` adds with ``MPI_Accumulate`` on both paths: element-wise atomic, no
update lost, whatever the mode.

Progress: a passive-target operation must not wait for its target to enter MPI. With
``progress="thread"`` (default) the inter-node path runs a :class:`.progress.ProgressThread`
that pokes MPI's progress engine; ``"mpich"`` relies on MPICH's own progress thread,
which the job must be launched with (``MPICH_ASYNC_PROGRESS=1``); ``"none"`` relies on
the library (e.g. RDMA hardware); a locked window's ``Win_lock`` is granted by the owner's
progress engine too (MPICH). The shared path needs none, locked or not: its loads, stores
and node-shared locks involve no other rank's progress.

Every wait on an operation's completion or a node-shared lock goes through
:meth:`Communicator.wait` / :meth:`Communicator.wait_for`, and every
call MPI offers only as blocking (window creation, ``Win_lock``/``Win_unlock``, the
``lock_all`` epoch, ``Win_flush_all``, ``Win_free``) through :meth:`Communicator.blocking`:
both are watchdogged and count as time blocked in MPI.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, cast

import torch
from mpi4py import MPI

from ..kernels import counters
from ..options import require_choice
from .communicator import MPI_TYPES, Communicator, mpi_buffer
from .device import Stager
from .progress import Progress, ProgressThread, resolve_progress

Layout = Literal["sharded", "server"]

#: Default size of one RMA operation: large float accumulates are not hardware atomics.
CHUNK_BYTES = 1 << 20
CACHE_LINE = 64

#: ``fn(center_slice, start, stop)``: change ``center_slice`` (elements start:stop) in place (a result is ignored).
UpdateFn = Callable[[torch.Tensor, int, int], object]


@dataclass(frozen=True)
class Piece:
    """One RMA operation's extent: elements ``start:stop`` of the vector, at ``disp`` in ``target``'s window."""

    target: int
    disp: int
    start: int
    stop: int


def shard_bounds(numel: int, size: int, layout: str, itemsize: int) -> list[tuple[int, int]]:
    """Each rank's ``(start, stop)`` of a vector of ``numel`` elements.

    ``"sharded"``: contiguous slices as equal as cache-line alignment allows;
    ``"server"``: everything on rank 0.
    """
    if layout == "server":
        return [(0, numel) if r == 0 else (numel, numel) for r in range(size)]
    align = max(1, CACHE_LINE // itemsize)
    per = -(-numel // size)
    per = -(-per // align) * align
    return [(min(r * per, numel), min((r + 1) * per, numel)) for r in range(size)]


def shared_window(comm: Communicator, total: int, zeroed: int, what: str) -> tuple[MPI.Win, torch.Tensor]:
    """A node-shared window of ``total`` bytes (collective over ``comm``'s node), its first ``zeroed``
    bytes zeroed before any rank reads them, locked for load/store access; and its bytes."""
    node = cast(MPI.Intracomm, comm.node)  # Split_type gives an intracommunicator
    comm.flush(what)  # no rank may block here while another waits for an operation it has not posted
    with comm.blocking("MPI_Win_allocate_shared"):
        win = MPI.Win.Allocate_shared(total if comm.local_rank == 0 else 0, 1, comm=node)
    memory = torch.frombuffer(MPI.buffer.fromaddress(win.Shared_query(0)[0].address, total), dtype=torch.uint8)
    if comm.local_rank == 0:
        memory[:zeroed].zero_()
    comm.wait(node.Ibarrier(), f"{what} setup")
    with comm.blocking("MPI_Win_lock_all"):
        win.Lock_all(MPI.MODE_NOCHECK)
    return win, memory


def free_window(comm: Communicator, win: MPI.Win) -> None:
    """Release a window of :func:`shared_window` (collective over the node)."""
    if win == MPI.WIN_NULL:
        return
    with comm.blocking("MPI_Win_unlock_all"):
        win.Unlock_all()
    with comm.blocking("MPI_Win_free"):
        win.Free()


class ShardLocks:
    """A reader-writer lock per shard, one int64 word a cache line in node-shared memory (the shared path's).

    Taken with an atomic compare-and-swap (:mod:`mpisolve.kernels.counters`), so a lock is
    granted by no other rank's progress engine (MPICH's ``Win_lock`` is granted by its
    owner's, which made a locked window run a progress thread in every rank). Collective over
    ``comm``, whose ranks share a node. A wait goes through :meth:`Communicator.wait_for`:
    watchdogged, and yielding the core where ranks share cores.
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        nbytes = comm.size * CACHE_LINE
        self.win, memory = shared_window(comm, nbytes, nbytes, "shared-vector locks")
        self.words = memory.view(torch.int64).numpy()[:: CACHE_LINE // 8]

    def shared(self, shard: int) -> None:
        """Take ``shard``'s lock shared with other readers (no writer holds it or waits for it)."""
        words = self.words
        if not counters.try_lock_shared(words, shard):
            self.comm.wait_for(lambda: bool(counters.try_lock_shared(words, shard)), self._what("shared", shard))

    def exclusive(self, shard: int) -> None:
        """Take ``shard``'s lock alone; while this waits, new readers wait too."""
        words = self.words
        if counters.try_lock_exclusive(words, shard, False):
            return
        counters.fetch_add(words, shard, counters.WAITING)
        try:
            self.comm.wait_for(
                lambda: bool(counters.try_lock_exclusive(words, shard, True)), self._what("exclusive", shard)
            )
        except BaseException:
            counters.fetch_add(words, shard, -counters.WAITING)  # no longer waiting: readers may come in
            raise

    def unlock_shared(self, shard: int) -> None:
        counters.unlock_shared(self.words, shard)

    def unlock_exclusive(self, shard: int) -> None:
        counters.unlock_exclusive(self.words, shard)

    def _what(self, kind: str, shard: int) -> str:
        return f"taking the {kind} lock on rank {shard}'s shard of a shared vector (node-shared)"

    def free(self) -> None:
        """Collective: release the lock words' window."""
        free_window(self.comm, self.win)


class _ProgressThread:
    """Pokes MPI's progress engine so that passive-target operations aimed at this rank complete."""

    def __init__(self, comm: MPI.Comm) -> None:
        self._comm = comm.Dup()  # a private communicator: the probe can never match a real message
        self._thread = ProgressThread(self._probe, name="mpisolve-rma-progress")

    def _probe(self) -> None:
        self._comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)

    def stop(self) -> None:
        self._thread.stop()
        self._comm.Free()


class SharedVector:
    """A flat vector of ``numel`` elements of ``dtype`` in an MPI window every rank updates one-sidedly.

    Collective to build, :meth:`store_`, :meth:`quiesce` and :meth:`close`; :meth:`read`,
    :meth:`accumulate` and :meth:`update` are one-sided (each rank alone). ``device``: put
    the vector in memory torch allocates there (the ``"device"`` path, see the module);
    by default MPI allocates it in host memory.
    """

    def __init__(
        self,
        comm: Communicator,
        numel: int,
        dtype: torch.dtype,
        *,
        layout: Layout = "sharded",
        locked: bool = False,
        force_internode: bool = False,
        progress: Progress = "thread",
        chunk_bytes: int = CHUNK_BYTES,
        device: torch.device | None = None,
    ) -> None:
        require_choice("layout", layout, Layout)
        progress = resolve_progress(progress, comm)
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"a shared vector holds float32 or float64, got {dtype}")
        if numel < 1 or chunk_bytes < 1:
            raise ValueError(f"numel and chunk_bytes must be >= 1, got {numel} and {chunk_bytes}")
        self.comm = comm
        self.numel = numel
        self.dtype = dtype
        self.layout = layout
        self.locked = locked
        if device is not None:
            self.path: str = "device"
        else:
            self.path = "internode" if force_internode or comm.nodes > 1 else "shared"
        #: Where the vector and the origin buffers of its one-sided operations live.
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self._mpi_type = MPI_TYPES[dtype]
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.bounds = shard_bounds(numel, comm.size, layout, itemsize)
        start, stop = self.bounds[comm.rank]
        info = MPI.Info.Create()
        info.Set("accumulate_ops", "same_op_no_op")  # SUM and NO_OP only: lets MPI use hardware atomics
        info.Set("same_disp_unit", "true")
        comm.flush("window creation")
        if self.path == "shared":
            with comm.blocking("MPI_Win_allocate_shared"):
                self.win = MPI.Win.Allocate_shared((stop - start) * itemsize, itemsize, info, comm.comm)
            self.view: torch.Tensor | None = self._map_whole(itemsize)
            self._local = self.view[start:stop]
        elif self.path == "device":
            self._local = torch.zeros(stop - start, dtype=dtype, device=self.device)
            if not isinstance(comm.comm, MPI.Intracomm):
                raise TypeError("a shared vector needs an intra-communicator")
            with comm.blocking("MPI_Win_create"):
                self.win = MPI.Win.Create(mpi_buffer(self._local)[0], itemsize, info, comm.comm)
            self.view = None
        else:
            with comm.blocking("MPI_Win_allocate"):
                self.win = MPI.Win.Allocate((stop - start) * itemsize, itemsize, info, comm.comm)
            self.view = None
            memory = self.win.tomemory()
            self._local = torch.frombuffer(memory, dtype=dtype) if stop > start else torch.empty(0, dtype=dtype)
        info.Free()
        chunk = max(1, chunk_bytes // itemsize)
        self.pieces = [
            Piece(t, s - lo, s, min(s + chunk, hi))
            for t, (lo, hi) in enumerate(self.bounds)
            for s in range(lo, hi, chunk)
        ]
        # Shards in the order this rank visits them: its own first, then round the ring.
        ring = [(comm.rank + i) % comm.size for i in range(comm.size)]
        self._shard_order = [t for t in ring if self.bounds[t][0] < self.bounds[t][1]]
        rma = self.path != "shared"
        self._scratch = torch.empty(numel, dtype=dtype, device=self.device) if rma else None
        self._before = torch.empty(numel, dtype=dtype, device=self.device) if rma and not locked else None
        # Device memory: RMA waits for the kernels queued so far, which write or read its buffers.
        self._kernels = Stager(self._local) if self.device.type == "cuda" else None
        self._scratch_specs = self._specs(self._scratch) if self._scratch is not None else []
        self._scratch_by_target = self._by_target(self._scratch) if self._scratch is not None else {}
        self._pending: list[MPI.Request] = []
        # RMA, and its Win_lock, completes by the target's progress engine; the shared path needs nobody's.
        self._progress = _ProgressThread(comm.comm) if rma and progress == "thread" else None
        #: The shared path's locks (None elsewhere: MPI's locks on the shard's owner).
        self._locks = ShardLocks(comm) if locked and not rma else None
        # One shared epoch for the window's life where nobody takes MPI's exclusive lock on it.
        self._lock_all = not locked or self._locks is not None
        if self._lock_all:
            with comm.blocking("MPI_Win_lock_all"):
                self.win.Lock_all(MPI.MODE_NOCHECK)
        self.closed = False

    def _map_whole(self, itemsize: int) -> torch.Tensor:
        """The whole vector as one tensor over the shared segments (contiguous, as MPI allocates by default)."""
        base = self.win.Shared_query(0)[0].address
        for rank, (lo, hi) in enumerate(self.bounds):
            if hi > lo and self.win.Shared_query(rank)[0].address != base + lo * itemsize:
                raise RuntimeError("MPI gave non-contiguous shared-memory segments; use force_internode=True")
        memory = MPI.buffer.fromaddress(base, self.numel * itemsize)
        return torch.frombuffer(memory, dtype=self.dtype)

    def _specs(self, tensor: torch.Tensor) -> list[list]:
        """MPI buffer specs of ``tensor``'s slices matching :attr:`pieces` (built once, reused)."""
        return [mpi_buffer(tensor[p.start : p.stop]) for p in self.pieces]

    def _target(self, piece: Piece) -> tuple[int, int, MPI.Datatype]:
        return (piece.disp, piece.stop - piece.start, self._mpi_type)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this shared vector is closed")

    # -------------------------------------------------------------- one-sided
    def read(self, out: torch.Tensor) -> None:
        """Copy the vector into ``out`` (contiguous, ``numel`` elements, same dtype): element-wise atomic."""
        self._check_open()
        if self.locked:
            by_target = self._by_target(out) if self.view is None else {}
            for target in self._shard_order:
                self._lock(target, MPI.LOCK_SHARED)
                self._read_shard(target, out, by_target.get(target, []))
                self._unlock(target, MPI.LOCK_SHARED)
        elif self.view is not None:
            self.win.Sync()
            out.copy_(self.view)
        else:
            self._get_accumulate(self._specs(out))

    def accumulate(self, delta: torch.Tensor) -> None:
        """Add ``delta`` to the vector with ``MPI_Accumulate(SUM)``: element-wise atomic, no update lost.

        Returns once ``delta`` may be reused; the additions land before any later
        read of this rank's (MPI orders accumulates to the same location).
        """
        self._check_open()
        if self.locked:
            self.update(lambda center, start, stop: center.add_(delta[start:stop]))
            return
        self._start_accumulate(self._specs(delta))
        self._wait_pending()

    def update(self, fn: UpdateFn) -> None:
        """Apply ``fn(center_slice, start, stop)`` to the vector, in place, shard by shard.

        Locked: each shard is locked exclusively for the read, ``fn`` and the write.
        Wild, shared path: ``fn`` runs on the window memory itself, racing other ranks.
        Wild, inter-node: ``fn`` runs on a fresh read and the difference is
        accumulated (element-wise atomic), completing by the next call.
        """
        self._check_open()
        if self.locked:
            for target in self._shard_order:
                lo, hi = self.bounds[target]
                self._lock(target, MPI.LOCK_EXCLUSIVE)
                if self.view is not None:
                    self.win.Sync()
                    fn(self.view[lo:hi], lo, hi)
                    self.win.Sync()
                else:
                    assert self._scratch is not None  # no view: the inter-node path, which has scratch space
                    pairs = self._scratch_by_target[target]
                    self._read_shard(target, self._scratch, pairs)
                    fn(self._scratch[lo:hi], lo, hi)
                    self._settle()
                    puts = [self.win.Rput(s, p.target, self._target(p)) for p, s in pairs]
                    self.comm.wait(puts, "shared-vector write")
                self._unlock(target, MPI.LOCK_EXCLUSIVE)
        elif self.view is not None:
            self.win.Sync()
            fn(self.view, 0, self.numel)
            self.win.Sync()
        else:
            assert self._scratch is not None and self._before is not None  # no view, not locked: inter-node, wild
            self._wait_pending()  # the scratch buffer is about to be overwritten
            self._get_accumulate(self._scratch_specs)
            self._before.copy_(self._scratch)
            fn(self._scratch, 0, self.numel)
            self._scratch.sub_(self._before)
            self._start_accumulate(self._scratch_specs)

    def _lock(self, target: int, lock_type: int) -> None:
        """Lock ``target``'s shard (``MPI.LOCK_SHARED`` or ``MPI.LOCK_EXCLUSIVE``)."""
        if self._locks is None:
            with self.comm.blocking("MPI_Win_lock", target):
                self.win.Lock(target, lock_type)
        elif lock_type == MPI.LOCK_EXCLUSIVE:
            self._locks.exclusive(target)
        else:
            self._locks.shared(target)

    def _unlock(self, target: int, lock_type: int) -> None:
        """Release what :meth:`_lock` took."""
        if self._locks is None:
            with self.comm.blocking("MPI_Win_unlock", target):
                self.win.Unlock(target)
        elif lock_type == MPI.LOCK_EXCLUSIVE:
            self._locks.unlock_exclusive(target)
        else:
            self._locks.unlock_shared(target)

    def _by_target(self, tensor: torch.Tensor) -> dict[int, list[tuple[Piece, list]]]:
        """:attr:`pieces` with the buffer specs of ``tensor``'s matching slices, grouped by target."""
        grouped: dict[int, list[tuple[Piece, list]]] = {}
        for piece, spec in zip(self.pieces, self._specs(tensor)):
            grouped.setdefault(piece.target, []).append((piece, spec))
        return grouped

    def _read_shard(self, target: int, out: torch.Tensor, pairs: list[tuple[Piece, list]]) -> None:
        """Inside a lock epoch on ``target``: copy its shard into ``out`` (through ``pairs`` off the shared path)."""
        if self.view is not None:
            lo, hi = self.bounds[target]
            self.win.Sync()
            out[lo:hi].copy_(self.view[lo:hi])
            return
        self._settle()
        self.comm.wait([self.win.Rget(s, p.target, self._target(p)) for p, s in pairs], "shared-vector read")

    def _get_accumulate(self, specs: list[list]) -> None:
        """Read every piece into ``specs`` with ``Rget_accumulate(NO_OP)`` (the origin is ignored) and wait."""
        self._settle()
        reads = [
            self.win.Rget_accumulate(s, s, p.target, self._target(p), MPI.NO_OP) for p, s in zip(self.pieces, specs)
        ]
        self.comm.wait(reads, "shared-vector read")

    def _start_accumulate(self, specs: list[list]) -> None:
        self._settle()
        self._pending = [
            self.win.Raccumulate(s, p.target, self._target(p), MPI.SUM) for p, s in zip(self.pieces, specs)
        ]

    def _settle(self) -> None:
        """On a GPU, wait until the kernels queued so far are done: MPI is about to read or write
        device memory they write or read (an event on the current stream, polled)."""
        if self._kernels is not None:
            self._kernels.to_mpi(values=False)
            self.comm.wait_for(self._kernels.ready, "device kernels before a one-sided operation")

    def _wait_pending(self) -> None:
        if self._pending:
            self.comm.wait(self._pending, "shared-vector accumulate")
            self._pending = []

    # -------------------------------------------------------------- collective
    def store_(self, values: torch.Tensor) -> None:
        """Collective: set the vector to ``values`` (each rank writes its own shard from its copy)."""
        self.quiesce()
        lo, hi = self.bounds[self.comm.rank]
        if self.locked:
            self._lock(self.comm.rank, MPI.LOCK_EXCLUSIVE)
        self._local.copy_(values[lo:hi])
        self._settle()  # others may read the shard as soon as the barrier below is passed
        self.win.Sync()
        if self.locked:
            self._unlock(self.comm.rank, MPI.LOCK_EXCLUSIVE)
        self.comm.barrier("shared-vector store")

    def quiesce(self) -> None:
        """Collective: complete this rank's operations, then wait until every rank has."""
        self._check_open()
        self._wait_pending()
        if not self.locked:
            with self.comm.blocking("MPI_Win_flush_all"):
                self.win.Flush_all()  # remote completion of the accumulates waited for above
        self.comm.barrier("shared-vector quiesce")

    def close(self) -> None:
        """Collective: drain every rank's operations and free the window (idempotent)."""
        if self.closed:
            return
        self.quiesce()
        if self._lock_all:
            with self.comm.blocking("MPI_Win_unlock_all"):
                self.win.Unlock_all()
        if self._progress is not None:
            self._progress.stop()
        if self._locks is not None:
            self._locks.free()
        self.view = None
        with self.comm.blocking("MPI_Win_free"):
            self.win.Free()
        self._local = torch.empty(0, dtype=self.dtype)  # memory torch allocated is released after the window
        self.closed = True

    def __enter__(self) -> SharedVector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalVector:
    """The shared vector of a job of one rank: a plain tensor on the parameters' device.

    Nobody else reads or writes it, so there is no window, no lock and no copy to the
    host: :meth:`update` runs its function on the tensor itself, on the device's current
    stream. It answers the calls of :class:`SharedVector` that the solvers make.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.numel = numel
        self.vector = torch.zeros(numel, dtype=dtype, device=device)

    def read(self, out: torch.Tensor) -> None:
        out.copy_(self.vector)

    def update(self, fn: UpdateFn) -> None:
        fn(self.vector, 0, self.numel)

    def store_(self, values: torch.Tensor) -> None:
        self.vector.copy_(values)

    def quiesce(self) -> None:
        pass

    def close(self) -> None:
        pass
