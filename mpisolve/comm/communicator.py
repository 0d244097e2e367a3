"""The MPI communicator every solver speaks through.

Only ``mpisolve.comm`` imports mpi4py. A :class:`Communicator` wraps an mpi4py
communicator with what solvers need: rank and size, the node-local split, zero-copy
buffer specs for torch tensors (CPU, or CUDA through :mod:`.device`: directly to a
CUDA-aware library, else staged through pinned host memory), nonblocking collectives,
and one ``wait`` that every blocking point goes through, so that waiting is polite on
oversubscribed nodes and a collective that never completes turns into an error (the
watchdog) instead of a hang. The pickled metadata collectives (``allgather_object``,
``bcast_object``, ``reduce_scalar``), which mpi4py offers only as blocking calls, are
preceded by a watchdogged barrier: once every rank has arrived, they cannot hang.
Calls MPI offers only as blocking (window locks, flushes, frees) go through
:meth:`Communicator.blocking`: a watchdog thread aborts the job if one outlasts the timeout.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar, cast, overload

import torch
from mpi4py import MPI

from ..errors import CollectiveInputError, CommTimeout, InputError
from .device import Stager, detect_cuda_aware, detect_stage_all, host_twin, local_device
from .engine import TorchGroup, rank_facts, resolve_engine

if TYPE_CHECKING:
    from typing_extensions import Unpack

T = TypeVar("T")

#: MPI datatypes for the torch dtypes MPI can reduce natively. float16 and bfloat16
#: have no standard MPI type: mpisolve reduces them in float32 (see buckets.py).
MPI_TYPES: dict[torch.dtype, MPI.Datatype] = {
    torch.float64: MPI.DOUBLE,
    torch.float32: MPI.FLOAT,
    torch.int64: MPI.INT64_T,
    torch.int32: MPI.INT32_T,
    torch.int16: MPI.INT16_T,
    torch.int8: MPI.INT8_T,
    torch.uint8: MPI.UINT8_T,
    torch.bool: MPI.C_BOOL,
}

MPI_OPS: dict[str, MPI.Op] = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}

WAIT_POLICIES = ("auto", "spin", "yield")

DEFAULT_TIMEOUT_S = 300.0

#: Under the "yield" wait policy, yield between polls this long before sleeping between them.
YIELD_BEFORE_SLEEP_S = 2e-3

#: How often the blocking-call watchdog looks for a call to watch while none is under way.
WATCH_INTERVAL_S = 0.1
#: Between a rank's error message (the watchdog's, an uncaught exception's) and its abort:
#: lets mpiexec forward it before tearing the job down.
ABORT_GRACE_S = 0.5


def mpi_buffer(tensor: torch.Tensor) -> list[Any]:
    """A zero-copy mpi4py buffer spec ``[memory, MPI datatype]`` for a contiguous tensor.

    A CPU tensor becomes a numpy array sharing its memory, so MPI reads and writes the
    tensor itself; nothing is pickled or copied. A CUDA tensor is passed as itself
    (mpi4py reads device memory through DLPack): only for a CUDA-aware library, after
    the producing stream is synchronized, which :meth:`Communicator.stager` arranges.
    Dtypes without an MPI type travel as bytes.
    """
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"mpi_buffer needs a CPU or CUDA tensor, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError("mpi_buffer needs a contiguous tensor")
    flat = tensor.detach().reshape(-1)
    mpi_type = MPI_TYPES.get(tensor.dtype)
    if mpi_type is None:
        flat, mpi_type = flat.view(torch.uint8), MPI.BYTE
    return [flat.numpy() if flat.device.type == "cpu" else flat, mpi_type]


def _all_done(requests: list[MPI.Request]) -> bool:
    """Test each request (one by one: MPICH 5's Testall fails on persistent collectives)."""
    return all(r.Test() for r in requests)


def _machine_id() -> str:
    """What ranks on one machine share: the kernel's boot id (containers on one kernel too), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # not Linux
        return socket.gethostname()


def _available_cpus() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


class Posting:
    """One MPI operation on device data: posted by :meth:`Communicator.start` once ``stagers`` are ready.

    ``post`` starts the operation and returns its request. A posting is made once and
    reused by every start of a persistent operation.
    """

    __slots__ = ("stagers", "post", "request", "posted", "_awaited")

    def __init__(self, stagers: Sequence[Stager], post: Callable[[], MPI.Request]) -> None:
        self.stagers = tuple(stagers)
        self.post = post
        self.request: MPI.Request = MPI.REQUEST_NULL
        self.posted = True  # nothing queued
        self._awaited = tuple(stager for stager in self.stagers if not stager.always_ready)

    def ready(self) -> bool:
        """Whether every stager's data is ready to be posted (host memory always is)."""
        for stager in self._awaited:
            if not stager.ready():
                return False
        return True


class CommunicatorOptions(TypedDict, total=False):
    """The policies :func:`init` passes on to :class:`Communicator`, which says what each means."""

    timeout_s: float | None
    wait: str | None
    cuda_aware: bool | None
    stage_all: bool | None
    node_shm: bool | None
    engine: str | None


def _timeout_seconds(timeout_s: float | None) -> float:
    """The watchdog's timeout: ``timeout_s``, else ``MPISOLVE_TIMEOUT``, else the default.

    A finite number of seconds > 0: every wait is watchdogged, so there is no infinite one.
    """
    given = timeout_s if timeout_s is not None else os.environ.get("MPISOLVE_TIMEOUT", DEFAULT_TIMEOUT_S)
    source = "timeout_s" if timeout_s is not None else "MPISOLVE_TIMEOUT"
    try:
        seconds = float(given)
    except ValueError:
        raise ValueError(f"{source} must be a number of seconds, got {given!r}") from None
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{source} must be a finite number of seconds > 0, got {given!r}")
    return seconds


class Communicator:
    """An mpi4py communicator with the node-local split, buffers and a watchdogged wait.

    ``timeout_s`` bounds every wait (default from ``MPISOLVE_TIMEOUT``, else 300 s).
    ``wait`` is how a rank waits: ``"spin"`` polls MPI flat out (best with a core per
    rank); ``"yield"`` polls and yields the core to other processes between polls, and
    after 2 ms sleeps between polls (backing off to 1 ms), so ranks sharing cores leave
    them to ranks that compute without slowing short operations; ``"auto"`` picks
    ``"yield"`` where the host runs more of the job's ranks than the cores they may use (default from
    ``MPISOLVE_WAIT``).

    ``cuda_aware`` says whether MPI may be given CUDA device memory (default: detected,
    or ``MPISOLVE_CUDA_AWARE=0/1``; see :func:`.device.detect_cuda_aware`). ``stage_all``
    (default ``MPISOLVE_STAGE=1``, else off) stages every tensor, CPU ones too, through its
    own host buffer: the staged path run without a GPU. ``node_shm``: whether sums between
    ranks of one node may go through node-shared memory (:mod:`.shm`; default True unless
    ``MPISOLVE_NODE_SHM=0``); False keeps every sum on MPI's own path. ``engine``: who runs
    the reusable sums and broadcasts, ``mpi``, ``nccl``, ``gloo`` or ``auto`` (default
    ``MPISOLVE_ENGINE``, else ``auto``; agreed by every rank; see :mod:`.engine`).
    Communicators split from this one inherit all four. ``device`` is the device this rank should compute on:
    GPU ``local_rank % count``, or the CPU.
    """

    def __init__(
        self,
        comm: MPI.Intracomm | None = None,
        *,
        timeout_s: float | None = None,
        wait: str | None = None,
        cuda_aware: bool | None = None,
        stage_all: bool | None = None,
        node_shm: bool | None = None,
        engine: str | None = None,
    ) -> None:
        self.timeout_s = _timeout_seconds(timeout_s)
        self.comm: MPI.Intracomm = comm if comm is not None else MPI.COMM_WORLD
        self.rank: int = self.comm.Get_rank()
        self.size: int = self.comm.Get_size()
        self.node: MPI.Comm = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank: int = self.node.Get_rank()
        self.local_size: int = self.node.Get_size()
        self.nodes: int = self.comm.allreduce(1 if self.local_rank == 0 else 0)
        cpus = _available_cpus()
        #: The cores this rank may run on.
        self.cores: int = len(cpus)
        #: This communicator's ranks on this rank's machine: the node's, or more where MPI sees several
        #: "nodes" on one machine (containers, the emulated cluster of tests/cluster), which share its cores.
        host = _machine_id()
        here = [set(theirs) for h, theirs in self.comm.allgather((host, cpus)) if h == host]
        self.host_size: int = max(self.local_size, len(here))
        #: The cores this machine's ranks may run on, together.
        self.host_cores: int = len(set().union(*here))
        #: Whether some rank of this machine is bound to only some of the cores its ranks may use.
        self.pinned: bool = any(theirs != here[0] for theirs in here)
        self.node_shm: bool = node_shm if node_shm is not None else os.environ.get("MPISOLVE_NODE_SHM", "1") != "0"
        policy = wait if wait is not None else os.environ.get("MPISOLVE_WAIT", "auto")
        if policy not in WAIT_POLICIES:
            raise ValueError(f"wait must be one of {WAIT_POLICIES}, got {policy!r}")
        if policy == "auto":
            policy = "yield" if self.shares_cores else "spin"
        self.wait_policy: str = policy
        #: Seconds this rank has spent blocked in :meth:`wait`, here and on communicators
        #: split from this one, for busy/comm/idle accounting.
        self.blocked_s: float = 0.0
        self._parent: Communicator | None = None
        self.cuda_aware, self.cuda_aware_source = detect_cuda_aware(cuda_aware)
        self.stage_all: bool = detect_stage_all(stage_all)
        self.device: torch.device = local_device(self.local_rank)
        #: Who runs the reusable sums and broadcasts (``mpi``, ``nccl`` or ``gloo``; :mod:`.engine`), and why.
        self.engine, self.engine_source = resolve_engine(self.comm.allgather(rank_facts(engine, self.device, host)))
        self._torch_group: TorchGroup | None = None
        self._named_splits: dict[Any, Communicator | None] = {}
        self._children: list[Communicator] = []
        self._on_free: list[Callable[[], None]] = []
        self._blocking: BlockingCall | None = None
        #: Callables run between the polls of every wait here and on communicators split from
        #: this one: a check ends the wait by raising (a solver's: another rank reached close()),
        #: or moves along work other ranks wait for (abs-sgd's node-shared round, which moves
        #: only when its rank tests it).
        self.interrupts: list[Callable[[], None]] = []
        # Operations started and not yet posted, in start order (see start()).
        self._queued: deque[Posting] = deque()
        self._queue_lock = threading.Lock()
        choose_threads(self)

    # ----------------------------------------------------------------- waiting
    def wait(self, requests: MPI.Request | Sequence[MPI.Request], what: str) -> None:
        """Complete ``requests``, polling politely, raising :class:`CommTimeout` past the timeout.

        ``what`` names the operation for the watchdog's message.
        """
        reqs = [requests] if isinstance(requests, MPI.Request) else list(requests)
        self.wait_for(lambda: _all_done(reqs), what)

    def wait_for(self, done: Callable[[], bool], what: str | Callable[[], str], *, transfers: bool = False) -> None:
        """Poll ``done`` (which drives MPI, e.g. by testing requests) until it returns True.

        The same polite polling and watchdog as :meth:`wait`, for waits that do work
        between polls (a multi-stage reduction advancing whichever stage is ready).
        ``what`` may be a callable, asked at a timeout (to say where the wait is stuck).
        ``transfers``: ``done`` moves MPI transfers between nodes along, whose data MPI moves
        only while this rank calls into it: the wait yields between polls and never sleeps
        (a sleep between polls would let a large message through a socket buffer at a time).
        """
        if done():
            return
        start = time.perf_counter()
        deadline = start + self.timeout_s
        # Short operations finish while yielding; only long waits start sleeping.
        sleep_after = math.inf if transfers else start + YIELD_BEFORE_SLEEP_S
        pause = 5e-5
        try:
            while not done():
                now = time.perf_counter()
                if now > deadline:
                    raise self.timed_out(what() if callable(what) else what)
                self.check_interrupts()
                if self.wait_policy == "yield":
                    if now < sleep_after:
                        os.sched_yield()
                    else:
                        time.sleep(pause)
                        pause = min(pause * 2, 1e-3)
        finally:
            self.add_blocked(time.perf_counter() - start)

    def check_interrupts(self) -> None:
        """Run the :attr:`interrupts` of this communicator and of those it was split from."""
        comm: Communicator | None = self
        while comm is not None:
            for check in comm.interrupts:
                check()
            comm = comm._parent

    def has_interrupts(self) -> bool:
        """Whether waits here run :attr:`interrupts` (of this communicator or one it was split from)."""
        comm: Communicator | None = self
        while comm is not None:
            if comm.interrupts:
                return True
            comm = comm._parent
        return False

    @property
    def shares_cores(self) -> bool:
        """Whether this machine runs more of this communicator's ranks than the cores they may use: they take turns."""
        return self.host_size > self.host_cores

    @property
    def cores_per_rank(self) -> float:
        """The cores this rank has to itself: its share of those this machine's ranks may use, at most its own."""
        return min(self.cores, self.host_cores / self.host_size)

    @property
    def shares_cores_evenly(self) -> bool:
        """Whether ranks :attr:`shares_cores` and none is bound to some of them: the kernel gives each an even share."""
        return self.shares_cores and not self.pinned

    def waits_in_mpi(self) -> bool:
        """Whether a wait here may block in MPI's own wait (:meth:`wait_in_mpi`) rather than poll.

        So it may where ranks yield their cores (they share them: MPI's wait hands the core to the
        ranks it waits for sooner than a poll from Python) and no wait here runs :attr:`interrupts`,
        which a rank blocked in MPI would not run.
        """
        return self.wait_policy == "yield" and not self.has_interrupts()

    def wait_in_mpi(self, posting: Posting, what: str) -> None:
        """Complete ``posting``'s operation in ``MPI_Wait`` under the watchdog thread (:meth:`blocking`).

        The watchdog aborts the job past the timeout. An operation still queued is posted first
        (a polled wait, for it and those queued before it, not for later ones).
        """
        if not posting.posted:

            def posted() -> bool:
                self.post_ready()
                return posting.posted

            self.wait_for(posted, f"{what}: to be posted")
        with self.blocking(what):
            posting.request.Wait()

    def blocking(self, what: str, target: int | None = None) -> BlockingCall:
        """A context for one call MPI offers only as blocking (``with comm.blocking("MPI_Win_lock", 2): ...``).

        Such a call cannot be polled by :meth:`wait`, so a watchdog thread watches it
        instead: past the timeout it reports :class:`CommTimeout` naming ``what`` (and
        the ``target`` rank) and aborts the job, since the blocked thread cannot raise.
        The time spent in the call counts in :attr:`blocked_s`. One call at a time, one
        watchdog thread for a communicator and those split from it.
        """
        if self._parent is not None:
            return self._parent.blocking(what, target)
        if self._blocking is None:
            self._blocking = BlockingCall(self)
        return self._blocking.arm(what, target)

    def add_blocked(self, seconds: float) -> None:
        """Count ``seconds`` spent blocked in MPI here and on the communicators this one was split from."""
        comm: Communicator | None = self
        while comm is not None:
            comm.blocked_s += seconds
            comm = comm._parent

    def timed_out(self, what: str) -> CommTimeout:
        """The watchdog's error for ``what``, which has waited ``timeout_s`` on this rank."""
        return CommTimeout(
            f"mpisolve: {what} did not complete within {self.timeout_s:g} s on rank {self.rank} of {self.size} "
            "(watchdog; the job aborts; set --comm-timeout or MPISOLVE_TIMEOUT to change it)"
        )

    # ---------------------------------------------------------- device memory
    def needs_staging(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` reaches MPI through a host twin: on a GPU, MPI not CUDA-aware; or under ``stage_all``."""
        return self.stage_all or (tensor.device.type == "cuda" and not self.cuda_aware)

    def host_twin(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A host buffer for staging ``tensor`` (pinned for a GPU tensor), or None where MPI takes it directly.

        Stagers of slices of one buffer share slices of its twin: ``Stager(t[a:b], twin[a:b])``.
        """
        return host_twin(tensor) if self.needs_staging(tensor) else None

    def stager(self, tensor: torch.Tensor, *, host: bool = False) -> Stager:
        """How ``tensor`` reaches MPI: directly, or through its own host twin.

        Call ``to_mpi()``, start the MPI operation on ``mpi_buffer(stager.memory)`` through
        :meth:`start` (it posts once the data is ready), and call ``from_mpi()`` after it
        completed. Keep the stager to reuse its host buffer. ``host``: the memory must be
        host memory whatever MPI takes (a window in host memory): a GPU tensor is staged.
        """
        staged = self.needs_staging(tensor) or (host and tensor.device.type != "cpu")
        return Stager(tensor, host_twin(tensor) if staged else None)

    # ---------------------------------------------------------------- posting
    def start(self, posting: Posting) -> None:
        """Queue ``posting``: MPI starts it once its stagers are ready, never before an operation started earlier here.

        Never blocks: device data may still be in the making (its stager's event not yet
        passed), and the autograd hooks that start gradient buckets must not wait for it.
        Operations are posted in the order they were started on this communicator, which
        is the same on every rank, so collectives still match; :meth:`test` and every wait
        post what has become ready.
        """
        if not posting.posted:
            raise RuntimeError("an MPI operation was started again before the last start was posted")
        posting.posted = False
        posting.request = MPI.REQUEST_NULL
        with self._queue_lock:
            if self._queued or not posting.ready():
                self._queued.append(posting)
            else:  # nothing started before it waits: post it now
                posting.request = posting.post()
                posting.posted = True
                return
        self.post_ready()

    def post_ready(self) -> None:
        """Post, in start order, the queued operations whose data is ready (safe from any thread)."""
        if not self._queued:
            return
        with self._queue_lock:
            while self._queued and self._queued[0].ready():
                posting = self._queued.popleft()
                posting.request = posting.post()
                posting.posted = True

    def test(self, posting: Posting) -> bool:
        """Whether ``posting``'s operation has completed (posting it first if it has become ready)."""
        if not posting.posted:
            self.post_ready()
            if not posting.posted:
                return False
        return posting.request.Test()

    def wait_posted(self, postings: Sequence[Posting], what: str) -> None:
        """Complete started operations through the watchdogged wait."""
        test = self.test
        self.wait_for(lambda: all(map(test, postings)), what)

    def unqueue(self, posting: Posting) -> None:
        """Drop ``posting`` if it is still queued (its operation is being freed unposted)."""
        with self._queue_lock:
            if not posting.posted:
                self._queued.remove(posting)
                posting.posted = True

    def has_queued(self) -> bool:
        """Whether an operation started here waits to be posted (:meth:`flush` waits for it)."""
        return bool(self._queued)

    def flush(self, what: str) -> None:
        """Wait until every operation started here has been posted (before a call MPI offers only as blocking)."""

        def all_posted() -> bool:
            self.post_ready()
            return not self._queued

        self.wait_for(all_posted, f"{what}: earlier operations to be posted")

    # ------------------------------------------------------------ collectives
    def allreduce_(self, tensor: torch.Tensor, op: str = "sum", what: str = "allreduce") -> torch.Tensor:
        """Reduce a contiguous CPU or CUDA tensor in place across ranks (through :meth:`wait`)."""
        stager = self.stager(tensor)
        spec, mpi_op = mpi_buffer(stager.memory), MPI_OPS[op]
        self._run(stager, lambda: self.comm.Iallreduce(MPI.IN_PLACE, spec, mpi_op), what)
        return tensor

    def bcast_(self, tensor: torch.Tensor, root: int = 0, what: str = "broadcast") -> torch.Tensor:
        """Broadcast a contiguous CPU or CUDA tensor in place from ``root``."""
        stager = self.stager(tensor)
        spec = mpi_buffer(stager.memory)
        self._run(stager, lambda: self.comm.Ibcast(spec, root=root), what)
        return tensor

    def _run(self, stager: Stager, post: Callable[[], MPI.Request], what: str) -> None:
        """One collective on ``stager``'s memory, start to end."""
        stager.to_mpi()
        posting = Posting([stager], post)
        self.start(posting)
        self.wait_posted([posting], what)
        stager.from_mpi()

    def barrier(self, what: str = "barrier") -> None:
        """Wait until every rank arrives (after every operation started here earlier has been posted)."""
        posting = Posting((), self.comm.Ibarrier)
        self.start(posting)
        self.wait_posted([posting], what)

    def reduce_scalar(self, value: float, op: str = "sum") -> float:
        """Reduce one Python number across ranks (for control values and measurements)."""
        self.barrier("reduce_scalar")
        return self.comm.allreduce(value, op=MPI_OPS[op])

    def allgather_object(self, obj: Any) -> list[Any]:
        """Small metadata only (pickled): signatures, names. Never tensors."""
        self.barrier("allgather_object")
        return self.comm.allgather(obj)

    def bcast_object(self, obj: Any, root: int = 0) -> Any:
        """Small metadata only (pickled). Never tensors."""
        self.barrier("bcast_object")
        return self.comm.bcast(obj, root=root)

    def persistent_allreduce(self, tensor: torch.Tensor, op: str = "sum") -> PersistentAllreduce:
        """MPI's reusable in-place allreduce of ``tensor`` (MPI-4 persistent where available).

        Solvers ask :func:`.reusable.reusable_sum`, which picks the engine; this is MPI's.
        """
        return PersistentAllreduce(self, tensor, op)

    def persistent_bcast(self, tensor: torch.Tensor, root: int = 0) -> PersistentBcast:
        """MPI's reusable broadcast of ``tensor`` from ``root`` (see :func:`.reusable.reusable_bcast`)."""
        return PersistentBcast(self, tensor, root)

    def engine_takes(self, tensor: torch.Tensor) -> bool:
        """Whether this communicator's torch.distributed engine (not MPI) runs reusable collectives on ``tensor``."""
        return self.engine == "gloo" or (self.engine == "nccl" and tensor.device.type == "cuda")

    def torch_group(self) -> TorchGroup:
        """This communicator's process group for its engine (made collectively on first use)."""
        if self.engine == "mpi":
            raise RuntimeError("this communicator's engine is MPI: it has no torch.distributed process group")
        if self._torch_group is None:
            self._torch_group = group = TorchGroup(
                self.engine, self.rank, self.size, self.timeout_s, lambda obj: self.bcast_object(obj)
            )
            self.on_free(group.close)
        return self._torch_group

    @overload
    def split(self, color: int, key: int | None = None, *, name: Any = None) -> Communicator: ...
    @overload
    def split(self, color: int | None, key: int | None = None, *, name: Any = None) -> Communicator | None: ...
    def split(self, color: int | None, key: int | None = None, *, name: Any = None) -> Communicator | None:
        """A sub-communicator with the same waiting policy and watchdog (collective).

        ``color`` None: this rank joins none (returns None). With ``name`` (the same on
        every rank), the split is made on the first call only and kept: later calls with
        that name return it without communicating, so hot paths can ask for it freely.
        """
        if name is not None and name in self._named_splits:
            return self._named_splits[name]
        self.flush("split")
        # mpi4py's stub types Split as Comm's; a split of an intracommunicator is one (MPI standard).
        sub = cast(
            MPI.Intracomm, self.comm.Split(MPI.UNDEFINED if color is None else color, self.rank if key is None else key)
        )
        return self._adopt(sub, name)

    def dup(self, *, name: Any = None) -> Communicator:
        """A duplicate of this communicator: the same ranks in the same order, its own message space (collective).

        Collectives on it never match those on this one, so a component (a solver, the
        trainer) can run its own alongside others'. ``name`` works as in :meth:`split`.
        """
        if name is not None and name in self._named_splits:
            child = self._named_splits[name]
            assert child is not None  # a duplicate always includes this rank
            return child
        self.flush("dup")
        # A split of one color keeping the ranks' order: a duplicate, made as the split(0) it replaces.
        child = self._adopt(cast(MPI.Intracomm, self.comm.Split(0, self.rank)), name)
        assert child is not None
        return child

    def _adopt(self, sub: MPI.Intracomm, name: Any) -> Communicator | None:
        """Wrap ``sub``, made from this communicator, with the same policies; :meth:`free` frees it."""
        child = None
        if sub != MPI.COMM_NULL:
            child = Communicator(
                sub,
                timeout_s=self.timeout_s,
                wait=self.wait_policy,
                cuda_aware=self.cuda_aware,
                stage_all=self.stage_all,
                node_shm=self.node_shm,
                engine=self.engine,
            )
            child._parent = self
            self._children.append(child)
        if name is not None:
            self._named_splits[name] = child
        return child

    def on_free(self, release: Callable[[], None]) -> None:
        """Have :meth:`free` call ``release`` first (collective MPI resources made on this communicator)."""
        self._on_free.append(release)

    def free(self) -> None:
        """Free what this wrapper made (collective).

        That is: what :meth:`on_free` was given, the communicators split from it (theirs in
        turn), its node split and, if it was itself split from another wrapper, its
        communicator. Never the world, nor a communicator the user wrapped (theirs
        to free). Collective over the ranks of ``comm``, with nothing in flight; the wrapper
        cannot be used afterwards.
        """
        for release in reversed(self._on_free):
            release()
        self._on_free.clear()
        for child in list(self._children):
            child.free()
        self._children.clear()
        self._named_splits.clear()
        if self.comm == MPI.COMM_WORLD:
            return
        if self.node != MPI.COMM_NULL:
            self.node.Free()
        if self._parent is not None:
            if self in self._parent._children:
                self._parent._children.remove(self)
            if self.comm != MPI.COMM_NULL:
                self.comm.Free()

    def agree(self, check: Callable[[], T]) -> T:
        """Run ``check`` on every rank; if it raises :class:`InputError` on any, raise it on all.

        Input checks that may fail on some ranks only (a file one rank cannot read, a
        world-size mismatch) go through here, so that every rank reports the same
        problem (the lowest failing rank's) and none is left waiting in a collective.
        """
        problem = None
        try:
            result = check()
        except InputError as err:
            problem = str(err)
        first = next((p for p in self.allgather_object(problem) if p is not None), None)
        if first is not None:
            raise CollectiveInputError(first)
        return result

    # ------------------------------------------------------------------ facts
    @staticmethod
    def library_version() -> str:
        """The MPI library's own version string, first line."""
        return MPI.Get_library_version().strip().splitlines()[0]

    def abort(self, code: int = 1) -> None:
        """End the whole job now (every rank), e.g. after an unrecoverable error."""
        self.comm.Abort(code)


class BlockingCall:
    """The watchdog of :meth:`Communicator.blocking`: a context manager and a daemon thread.

    Entering marks the call under way (name, target, start); leaving clears the mark and
    counts the time blocked. The thread sleeps until the marked call's deadline and, if
    the same call is still under way then, writes the watchdog's message to stderr and
    aborts the job through :meth:`Communicator.abort`. Reused for every call, so the
    training step allocates nothing but the mark.
    """

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm
        self._what = ""
        self._target: int | None = None
        self._call: tuple[str, int | None, float] | None = None
        self._thread = threading.Thread(target=self._watch, name="mpisolve-watchdog", daemon=True)
        self._thread.start()

    def arm(self, what: str, target: int | None) -> BlockingCall:
        """Name the next call to watch, ``what`` (with its peer ``target``, if any); calls do not nest."""
        if self._call is not None:
            raise RuntimeError(f"blocking call {what} started inside {self._call[0]}: they do not nest")
        self._what, self._target = what, target
        return self

    def __enter__(self) -> None:
        self._call = (self._what, self._target, time.perf_counter())

    def __exit__(self, *exc: object) -> None:
        call, self._call = self._call, None
        assert call is not None  # __enter__ set it
        self._comm.add_blocked(time.perf_counter() - call[2])

    def _watch(self) -> None:
        while True:
            call = self._call
            if call is None:
                time.sleep(WATCH_INTERVAL_S)
                continue
            left = call[2] + self._comm.timeout_s - time.perf_counter()
            if left > 0:
                time.sleep(left)  # a call started meanwhile has a later deadline: looked at next round
            elif self._call is call:
                what, target, _ = call
                err = self._comm.timed_out(what if target is None else f"{what} (target rank {target})")
                sys.stderr.write(f"{type(err).__name__}: {err}\n")
                sys.stderr.flush()
                time.sleep(ABORT_GRACE_S)
                self._comm.abort(1)
                return


class PersistentCollective:
    """An in-place collective on one buffer, set up once and started many times.

    Uses an MPI-4 persistent collective (``MPI_*_init``: set up once, nothing allocated
    per start) and falls back to posting the nonblocking collective on every start on
    MPI libraries without it. Subclasses say which collective. The tensor reaches MPI
    through ``comm.stager`` (one host twin where it is staged, reused by every start):
    :meth:`start` queues the copy and posts once the data is ready, without blocking;
    :meth:`test` says whether it has completed; :meth:`wait` completes it and brings the
    result into the tensor. A staged result reaches the tensor only through :meth:`wait`
    (at once after a true :meth:`test`), on the waiting thread's current stream. Over one
    rank (``alone``) the collective is the buffer as it is: nothing is staged or posted.
    """

    kind = "collective"  # names the operation for the watchdog

    def __init__(self, comm: Communicator, tensor: torch.Tensor) -> None:
        self.comm = comm
        self.tensor = tensor
        #: One rank, staging not forced: an in-place collective leaves the buffer as it is, so
        #: nothing is staged and no MPI operation is posted (a GPU tensor is not copied to the host).
        self.alone = comm.size == 1 and not comm.stage_all
        self.stager = Stager(tensor) if self.alone else comm.stager(tensor)
        self._persistent: MPI.Prequest | None = None
        if not self.alone:
            self._spec = mpi_buffer(self.stager.memory)
            try:
                self._persistent = self._init()
            except NotImplementedError:
                self._persistent = None
        self.posting = Posting([self.stager], self._post_start)

    def _init(self) -> MPI.Prequest:
        raise NotImplementedError

    def _post(self) -> MPI.Request:
        raise NotImplementedError

    def _post_start(self) -> MPI.Request:
        if self._persistent is not None:
            self._persistent.Start()
            return self._persistent
        return self._post()

    def start(self) -> None:
        """Start the collective on the tensor's current values (posted once they are ready)."""
        if self.alone:
            return  # complete already: the posting stays posted, its request null
        self.stager.to_mpi()
        self.comm.start(self.posting)

    def test(self) -> bool:
        """Whether the collective has completed (call :meth:`wait` to bring a staged result back)."""
        return self.comm.test(self.posting)

    def wait(self, what: str | None = None, *, in_mpi: bool = False) -> None:
        """Complete the collective; the tensor holds the result (for a staged one, on its stream).

        ``in_mpi``: where the communicator allows it (:meth:`Communicator.waits_in_mpi`), wait in
        ``MPI_Wait`` under the watchdog thread (a timeout aborts the job) rather than poll (a timeout
        raises :class:`CommTimeout`).
        """
        if self.alone:
            return
        if in_mpi and self.comm.waits_in_mpi():
            self.comm.wait_in_mpi(self.posting, what or self.kind)
        else:
            self.comm.wait_posted([self.posting], what or self.kind)
        self.stager.from_mpi()

    def free(self) -> None:
        """Release the persistent request.

        Refused while a started collective has not completed (MPI forbids freeing an active
        request: complete it first, on every rank).
        """
        posting = self.posting
        if not posting.posted or (posting.request != MPI.REQUEST_NULL and not posting.request.Test()):
            raise RuntimeError(f"a persistent {self.kind} was freed while still in flight: complete it first")
        if self._persistent is not None:
            self._persistent.Free()
            self._persistent = None


class PersistentAllreduce(PersistentCollective):
    """An in-place allreduce of one buffer, started many times (``MPI_Allreduce_init``)."""

    kind = "allreduce"

    def __init__(self, comm: Communicator, tensor: torch.Tensor, op: str = "sum") -> None:
        self._op = MPI_OPS[op]
        super().__init__(comm, tensor)

    def _init(self) -> MPI.Prequest:
        return self.comm.comm.Allreduce_init(MPI.IN_PLACE, self._spec, self._op)

    def _post(self) -> MPI.Request:
        return self.comm.comm.Iallreduce(MPI.IN_PLACE, self._spec, self._op)


class PersistentBcast(PersistentCollective):
    """A broadcast of one buffer from ``root``, started many times (``MPI_Bcast_init``)."""

    kind = "broadcast"

    def __init__(self, comm: Communicator, tensor: torch.Tensor, root: int = 0) -> None:
        if not 0 <= root < comm.size:
            raise ValueError(
                f"a broadcast's root must be a rank of the communicator (0 to {comm.size - 1}), got {root}"
            )
        self.root = root
        super().__init__(comm, tensor)

    def _init(self) -> MPI.Prequest:
        return self.comm.comm.Bcast_init(self._spec, root=self.root)

    def _post(self) -> MPI.Request:
        return self.comm.comm.Ibcast(self._spec, root=self.root)


_WORLD: Communicator | None = None
_INIT_LOCK = threading.Lock()


def _abort_on_uncaught(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    """Report the error, then abort the job.

    The error's own line comes first, and the abort waits ``ABORT_GRACE_S``: when a job is
    torn down, mpiexec may drop what a rank wrote last, and a traceback ends with its line.
    """
    multi_rank = MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1
    if multi_rank:
        sys.stderr.write(f"{exc_type.__name__}: {exc} (rank {MPI.COMM_WORLD.Get_rank()}; traceback below)\n")
        sys.stderr.flush()
    sys.__excepthook__(exc_type, exc, tb)
    sys.stderr.flush()
    if multi_rank:
        time.sleep(ABORT_GRACE_S)
        MPI.COMM_WORLD.Abort(1)


def init(*, threads: int | None = None, **options: Unpack[CommunicatorOptions]) -> Communicator:
    """Initialise mpisolve on ``MPI.COMM_WORLD`` and return the world communicator.

    ``options`` are :class:`Communicator`'s keywords, with their meanings and defaults there:
    ``timeout_s``, ``wait``, ``cuda_aware``, ``stage_all``, ``node_shm``, ``engine``.

    Also makes an uncaught exception on any rank abort the whole job (as
    ``python -m mpi4py`` does), gives each rank its share of the node's cores for
    torch's intra-op threads unless ``OMP_NUM_THREADS`` or ``threads`` says otherwise
    (the first communicator made does that, however it is made: :func:`choose_threads`),
    and, where CUDA is available, makes ``comm.device`` (GPU ``local_rank % count``)
    torch's current device. Calling it again returns the same communicator.
    """
    global _WORLD
    with _INIT_LOCK:
        if _WORLD is None:
            _WORLD = Communicator(**options)
            if _WORLD.device.type == "cuda":
                torch.cuda.set_device(_WORLD.device)
            if sys.excepthook is sys.__excepthook__:
                sys.excepthook = _abort_on_uncaught
            if threads is not None:
                choose_threads(_WORLD, threads)
        return _WORLD


#: Whether torch's intra-op thread count was chosen in this process (:func:`choose_threads`).
_threads_chosen = False


def choose_threads(comm: Communicator, threads: int | None = None) -> None:
    """Set torch's intra-op threads for this rank.

    ``threads`` if given; else, once per process (the first communicator made, however it
    was made) and unless ``OMP_NUM_THREADS`` is set, the machine's cores over ``comm``'s
    ranks on it, at least 1, as torchrun gives each of its processes.
    """
    global _threads_chosen
    if threads is not None:
        torch.set_num_threads(threads)
    elif not _threads_chosen and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, comm.cores // comm.host_size))
    _threads_chosen = True


def mpi4py_version() -> str:
    """The version of mpi4py (for run summaries: only this package imports mpi4py)."""
    import mpi4py

    return mpi4py.__version__


def finalize() -> None:
    """Finalize MPI now (for a clean exit after a :class:`CollectiveInputError`)."""
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def as_communicator(comm: MPI.Comm | Communicator | None) -> Communicator:
    """The communicator a solver or collective should use: the world by default.

    An mpi4py communicator is wrapped once: the wrapper is cached on the communicator
    itself (an MPI attribute), so a later call with it (or with another mpi4py object of
    the same communicator) gets the same wrapper back without communicating, and freeing
    the communicator frees what the wrapper made (its node split, Adasum's splits).
    """
    if comm is None:
        return init() if _WORLD is None else _WORLD
    if isinstance(comm, Communicator):
        return comm
    if isinstance(comm, MPI.Comm):
        if comm == MPI.COMM_WORLD:
            return init()
        # Other communicators are wrapped once and the wrapper kept on the communicator
        # (an attribute), so repeated calls reuse it and it goes with the communicator.
        keyval = _wrapper_keyval()
        wrapper = comm.Get_attr(keyval)
        if not isinstance(wrapper, Communicator):
            wrapper = Communicator(MPI.Intracomm(comm))  # intercommunicators raise
            comm.Set_attr(keyval, wrapper)
        return wrapper
    raise TypeError(f"comm must be an mpi4py communicator or a mpisolve Communicator, got {type(comm).__name__}")


_WRAPPER_KEYVAL: int | None = None


def _free_wrapper(comm: MPI.Comm, keyval: int, wrapper: Communicator) -> None:
    """The attribute's delete callback: runs inside ``comm.Free()``, on every rank of ``comm``."""
    wrapper.free()


def _wrapper_keyval() -> int:
    global _WRAPPER_KEYVAL
    with _INIT_LOCK:
        if _WRAPPER_KEYVAL is None:
            _WRAPPER_KEYVAL = MPI.Comm.Create_keyval(delete_fn=_free_wrapper)
        return _WRAPPER_KEYVAL


__all__ = [
    "BlockingCall",
    "Posting",
    "CommTimeout",
    "Communicator",
    "PersistentAllreduce",
    "PersistentBcast",
    "PersistentCollective",
    "as_communicator",
    "init",
    "mpi_buffer",
    "MPI_TYPES",
]
