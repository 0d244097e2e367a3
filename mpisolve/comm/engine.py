"""Engines behind the reusable sums and broadcasts: MPI, or a torch.distributed process group.

Every collective a solver runs again and again (its gradient buckets, parameter averages,
K-FAC's factor sums and inverse broadcasts) is asked for one way,
:func:`~.reusable.reusable_sum` / :func:`~.reusable.reusable_bcast`, and is a
:class:`Reusable`: ``start`` (never blocks), ``test``, ``wait`` (watchdogged), ``free``.
Which engine answers is the communicator's choice (``Communicator(engine=...)``, else
``MPISOLVE_ENGINE``, else ``auto``), agreed by every rank:

- ``"mpi"``: MPI's persistent collectives, on host tensors, on device tensors directly
  where the library is CUDA-aware, else staged through pinned host memory (see
  :mod:`.device`); node-shared sums where they apply (:mod:`.shm`).
- ``"nccl"``: device tensors go to NCCL (torch's ``ProcessGroupNCCL``), on NCCL's own
  stream: the current stream waits for a collective on the device, the host never does.
  Host tensors stay with MPI. Needs every rank to own its GPU (NCCL refuses two ranks on
  one device). ``auto`` picks it exactly when every rank has a GPU of its own and torch
  has NCCL; ranks sharing a GPU fall back to MPI.
- ``"gloo"``: every reusable collective, on CPU or CUDA tensors, goes to gloo: the same
  engine code as NCCL's, run where there is no NCCL (CI, two ranks sharing a GPU). Node-
  shared sums are off with it.

A process group is made per communicator, on first use (collectively), over a
``TCPStore`` that its rank 0 serves and whose address it broadcasts over MPI, so nothing
but MPI is needed to start it (``MPISOLVE_STORE_HOST`` names the address to serve on
where the host name does not reach the other nodes). Its operations time out after the
communicator's ``timeout_s``: gloo's waits poll through the communicator's watchdog;
NCCL's are watched by torch's NCCL watchdog, which aborts the communicator on timeout.
MPI keeps control messages, host tensors and the one-sided windows. Point-to-point
messages that a solver sends again and again (Adasum's pairwise steps) are a
:class:`TorchMessage` where the engine takes them.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

ENGINES: tuple[str, ...] = ("auto", "mpi", "nccl", "gloo")
#: Chooses the engine (``mpi``, ``nccl``, ``gloo`` or ``auto``) where the communicator is not told.
ENGINE_ENV = "MPISOLVE_ENGINE"
#: The address a process group's store is served on (default: the host name of its rank 0).
STORE_HOST_ENV = "MPISOLVE_STORE_HOST"

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Reusable(Protocol):
    """A collective on one tensor, set up once and run many times."""

    def start(self) -> None:
        """Start it on the tensor's current values (never blocks the host)."""

    def test(self) -> bool:
        """Whether it has completed (``wait`` then brings the result into the tensor)."""

    def wait(self, what: str | None = None) -> None:
        """Complete it (watchdogged): the tensor holds the result for work queued after."""

    def free(self) -> None:
        """Release it (not while in flight)."""


class InFlight:
    """The reusable collectives a step started, in order, until each is seen complete.

    Testing them while backward computes lets MPI move them along (:meth:`progress`); a
    step that completed its last one forgets them all (:meth:`clear`).
    """

    def __init__(self) -> None:
        self._ops: list[Reusable] = []

    def start(self, op: Reusable) -> None:
        """Start ``op`` and keep it until it is seen complete."""
        op.start()
        self._ops.append(op)

    def progress(self) -> None:
        """Test the ones in flight, keeping those not complete yet."""
        if self._ops:
            self._ops = [op for op in self._ops if not op.test()]

    def clear(self) -> None:
        """Forget them all (the step completed every one)."""
        self._ops.clear()

    def __len__(self) -> int:
        """How many are kept as in flight."""
        return len(self._ops)


#: What one rank says for the choice: the engine it was asked for and by what, its machine, its
#: GPU's index (None: no GPU), whether its torch has NCCL.
Facts = tuple[str, str, str, "int | None", bool]


def rank_facts(option: str | None, device: torch.device, machine: str) -> Facts:
    """This rank's part of the choice: ``option``, else ``MPISOLVE_ENGINE``, else ``auto``; and what it
    runs on (``machine``: what ranks on one machine share)."""
    if option is not None:
        choice, source = option, f"option engine={option!r}"
    else:
        choice = os.environ.get(ENGINE_ENV, "auto").strip().lower() or "auto"
        source = f"{ENGINE_ENV}={choice}" if ENGINE_ENV in os.environ else "auto"
    gpu = device.index if device.type == "cuda" else None
    return choice, source, machine, gpu, dist.is_available() and dist.is_nccl_available()


def resolve_engine(facts: Sequence[Facts]) -> tuple[str, str]:
    """The engine every rank uses, from every rank's :func:`rank_facts`, and why (the same on every rank).

    Raises ValueError, on every rank alike, where a rank asked for an unknown engine, the
    ranks asked for different ones, or ``nccl`` was asked for where it cannot run.
    """
    for rank, (choice, source, *_) in enumerate(facts):
        if choice not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {choice!r} on rank {rank} ({source})")
    choices = sorted({f[0] for f in facts})
    if len(choices) > 1:
        by_rank = ", ".join(f"rank {r}: {f[0]}" for r, f in enumerate(facts))
        raise ValueError(f"the ranks asked for different engines ({by_rank}); set {ENGINE_ENV} alike on every rank")
    choice, source = facts[0][0], facts[0][1]
    if choice in ("mpi", "gloo"):
        return choice, source
    devices = [(f[2], f[3]) for f in facts]
    problem = None
    if not all(f[4] for f in facts):
        problem = "torch was built without NCCL"
    elif any(device is None for _, device in devices):
        problem = "some rank has no GPU"
    elif len(set(devices)) < len(devices):
        problem = "ranks share a GPU (NCCL refuses two ranks on one device)"
    if choice == "nccl":
        if problem is not None:
            raise ValueError(f"engine 'nccl' ({source}) cannot run here: {problem}; use engine='mpi'")
        return "nccl", source
    return ("mpi", f"auto: {problem}") if problem is not None else ("nccl", "auto: every rank owns a GPU")


class TorchGroup:
    """A torch.distributed process group (``backend`` nccl or gloo) over one communicator's ranks.

    Collective to make: rank 0 serves a ``TCPStore`` on a free port and broadcasts its
    address with ``bcast`` (an MPI broadcast of a small object); every rank then joins.
    """

    def __init__(self, backend: str, rank: int, size: int, timeout_s: float, bcast: Callable[[object], object]) -> None:
        self.backend = backend
        timeout = datetime.timedelta(seconds=timeout_s)
        host = os.environ.get(STORE_HOST_ENV) or socket.gethostname()
        if rank == 0:
            store = dist.TCPStore(host, 0, size, True, timeout=timeout, wait_for_workers=False)
            bcast((host, store.port))
        else:
            served = bcast(None)
            assert isinstance(served, tuple)
            store = dist.TCPStore(served[0], served[1], size, False, timeout=timeout)
        self._store = store
        self._waiter: _Waiter | None = None
        # torch's stubs type these backends without their collectives: the calls below are checked by the tests.
        self.group: Any
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, size, timeout)

    def takes(self, tensor: torch.Tensor) -> bool:
        """Whether this group moves ``tensor`` (NCCL: CUDA tensors; gloo: CPU and CUDA ones)."""
        return tensor.device.type == "cuda" or self.backend == "gloo"

    def allreduce(self, tensor: torch.Tensor, op: str) -> dist.Work:
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp(_OPS[op])
        return self.group.allreduce([tensor], options)

    def broadcast(self, tensor: torch.Tensor, root: int) -> dist.Work:
        options = dist.BroadcastOptions()
        options.rootRank = root
        return self.group.broadcast([tensor], options)

    def takes_p2p(self, tensor: torch.Tensor) -> bool:
        """Whether this group sends and receives ``tensor`` (NCCL: CUDA tensors; gloo: CPU ones)."""
        return tensor.device.type == ("cuda" if self.backend == "nccl" else "cpu")

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        return self.group.send([tensor], peer, tag)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work:
        return self.group.recv([tensor], peer, tag)

    def await_p2p(self, work: dist.Work, message: TorchMessage) -> None:
        """gloo: have this group's one waiter thread wait for ``work`` and then tell ``message``."""
        if self._waiter is None:
            self._waiter = _Waiter()
        self._waiter.put(work, message)

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.stop()
            self._waiter = None
        shutdown = getattr(self.group, "shutdown", None)
        if shutdown is not None and self.backend == "nccl":
            shutdown()


class _Waiter:
    """One daemon thread that waits for a group's gloo sends and receives, one after another, as posted.

    A gloo send or receive says it completed only once waited for, and a wait blocks: the
    thread waits for each in turn and tells its message (done, or the error), so that the
    rank's thread only tests. They complete in gloo's own threads whether or not anyone
    waits, so waiting in posting order holds nothing up but the news of a later one. A wait
    that fails (gloo's timeout, a peer gone) is told to its message, and the next is waited
    for; the rank's watchdog ends a wait for a message whose news does not come.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[dist.Work, TorchMessage] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="mpisolve-gloo-p2p", daemon=True)
        self._thread.start()

    def put(self, work: dist.Work, message: TorchMessage) -> None:
        self._queue.put((work, message))

    def stop(self) -> None:
        """Let the thread end once it has waited for what was posted (it is not joined: a wait may hang)."""
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            work, message = item
            try:
                work.wait()
            except BaseException as error:  # a gloo timeout or a peer gone: raised where the rank tests
                message.settle(error)
            else:
                message.settle(None)


class TorchCollective:
    """A :class:`Reusable` allreduce (``root`` None) or broadcast of ``tensor`` through a :class:`TorchGroup`.

    ``wait_for(done, what)`` is the communicator's watchdogged wait: a gloo collective is
    polled through it; an NCCL one is not waited for by the host at all (its ``wait``
    makes the current stream wait for NCCL's).
    """

    def __init__(
        self,
        group: TorchGroup,
        tensor: torch.Tensor,
        wait_for: Callable[[Callable[[], bool], str], None],
        *,
        op: str = "sum",
        root: int | None = None,
    ) -> None:
        if not tensor.is_contiguous():
            raise ValueError("a reusable collective needs a contiguous tensor")
        if op not in _OPS:
            raise ValueError(f"op must be one of {', '.join(_OPS)}, got {op!r}")
        self.group = group
        self.tensor = tensor
        self.kind = "allreduce" if root is None else "broadcast"
        self._op, self._root = op, root
        self._wait_for = wait_for
        self._work: dist.Work | None = None

    def start(self) -> None:
        work = self._work
        if work is not None:  # tested complete and never waited for (a broadcast's root may do so)
            if not work.is_completed():
                raise RuntimeError(f"a reusable {self.kind} was started again before it completed")
            work.wait()
        if self._root is None:
            self._work = self.group.allreduce(self.tensor, self._op)
        else:
            self._work = self.group.broadcast(self.tensor, self._root)

    def test(self) -> bool:
        return self._work is None or self._work.is_completed()

    def wait(self, what: str | None = None) -> None:
        work, self._work = self._work, None
        if work is None:
            return
        if self.group.backend != "nccl":
            self._wait_for(work.is_completed, what or f"{self.group.backend} {self.kind}")
        work.wait()

    def free(self) -> None:
        if self._work is not None and not self._work.is_completed():
            raise RuntimeError(f"a reusable {self.kind} was freed while still in flight: complete it first")
        self._work = None


class TorchMessage:
    """One send (or receive, ``receive``) of ``tensor`` to (from) ``peer`` through a :class:`TorchGroup`,
    started many times: ``start``, ``test``, ``wait``, ``free``, as a :class:`Reusable`.

    NCCL: stream-ordered, so :meth:`test` is true once started and :meth:`wait` makes the
    current stream wait for NCCL's (the host never does). NCCL matches a pair's messages
    in the order they are posted (``tag`` is gloo's only): both sides post them in one
    order. gloo: a send or receive says it completed only once waited for, so the group's
    one waiter thread waits for it and :meth:`test` reads what it found; :meth:`wait` polls
    that through ``wait_for``, the communicator's watchdogged wait, as a gloo collective is polled.
    """

    def __init__(
        self,
        group: TorchGroup,
        tensor: torch.Tensor,
        peer: int,
        tag: int,
        wait_for: Callable[[Callable[[], bool], str], None],
        *,
        receive: bool,
    ) -> None:
        if not tensor.is_contiguous():
            raise ValueError("a message needs a contiguous tensor")
        self.group = group
        self.tensor = tensor
        self.peer, self.tag = peer, tag
        self.receive = receive
        self._wait_for = wait_for
        self._work: dist.Work | None = None
        self._done = threading.Event()
        self._error: BaseException | None = None

    def start(self) -> None:
        if self._work is not None:
            raise RuntimeError(f"a {self._kind()} was started again before it was waited for")
        post = self.group.recv if self.receive else self.group.send
        self._work = post(self.tensor, self.peer, self.tag)
        if self.group.backend != "nccl":
            self._done.clear()
            self._error = None
            self.group.await_p2p(self._work, self)

    def settle(self, error: BaseException | None) -> None:
        """gloo: the waiter thread found this message complete (``error``: its wait failed)."""
        self._error = error
        self._done.set()

    def test(self) -> bool:
        if self._work is None or self.group.backend == "nccl":
            return True
        if self._error is not None:
            raise RuntimeError(f"mpisolve: a gloo {self._kind()} failed: {self._error}") from self._error
        return self._done.is_set()

    def wait(self, what: str | None = None) -> None:
        work = self._work
        if work is None:
            return
        if self.group.backend == "nccl":
            work.wait()
        else:  # the thread waited for it (a second wait would wait for another message)
            self._wait_for(self.test, what or f"gloo {self._kind()}")
        self._work = None

    def free(self) -> None:
        if self._work is not None and not self.test():
            raise RuntimeError(f"a {self._kind()} was freed while still in flight: complete it first")
        self._work = None

    def _kind(self) -> str:
        return f"receive from rank {self.peer}" if self.receive else f"send to rank {self.peer}"
