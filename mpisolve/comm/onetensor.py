"""An allreduce of one CPU tensor: its signature agreed once, then one message a call.

``mpisolve.allreduce`` of one tensor and ``hvd.allreduce`` (each allreduce of one tensor that
:class:`.ops.TensorOps` starts, :class:`.ops.OneCall`) come here. The general path
(:func:`.collectives.allreduce`, or :mod:`.ops`' header round and data round) fuses, posts
nonblocking rounds and waits for them through the watchdog: per call costs that are several
times MPI's own latency for a few KiB. Here a sum or average of one float32 or float64 CPU
tensor is checked across ranks once per signature (dtype, shape, reduction, prescale and
postscale factors), then each call is one message, waited for at once, that carries the
values and one more number, a *miss* flag (:class:`Message`):

- where node-shared sums apply (:func:`.shm.node_group`), from the one-shot crossover
  (:attr:`.shm.NodeGroup.one_shot_min_bytes`, by default every size) and up to a window of
  the cap on kept node-shared memory (:attr:`.shm.NodeGroup.keep_bytes`), one round of a
  node-shared sum (:class:`NodeMessage`: a :class:`.shm.NodeAllreduce` kept per element
  count and dtype, of the values and the flag): the values copied into the node's window,
  summed there and, across nodes, among the nodes' ranks, with no MPI call on one node;
- else, up to :data:`INLINE_MAX_BYTES`, one start of a persistent allreduce
  (``MPI_Allreduce_init``, made by every rank when they agree the signature, on a buffer
  kept with it: :class:`InlineMessage`) of the values and the flag, on a communicator of
  its own; above it, an ``MPI_Iallreduce`` of the flag alone and then one blocking
  ``MPI_Allreduce`` of the tensor from where it lies into a kept buffer (for large tensors
  the copy into the message would cost more than the flag's own latency).

The sum is copied out into the new result: MPI moves messages between buffers it has seen
before faster than into new memory each call. A call with the agreed signature is told by
comparing its dtype, shape, reduction and scales with the agreed ones as they are, and a
tensor sent again reuses its numpy view.

**The check, kept cheap.** Every rank holds the same *agreed* signature (the last one every
rank negotiated, or none): it changes only after a negotiation, which every rank runs alike.
A call whose signature is the agreed one sends the flag 0 with its values; any other call
sends a miss in the agreed signature's message (so every rank takes part in the same
message, whatever its own call; with none agreed, the flag alone). The flags'
sum is the same on every rank: 0 means every rank called with the agreed signature;
otherwise every rank negotiates: the ranks' signatures are gathered (one small
``allgather``), and where they differ every rank raises :class:`TensorMismatchError`
naming them, as the checked collectives of :mod:`.ops` do, and nothing hangs. Where they
agree, that signature becomes the agreed one. Where the agreed signature does not take
this path (another reduction, another dtype, a GPU or non-contiguous tensor on some rank),
each call sends only the flag before taking the
general path, so a rank that calls with another signature is still noticed.

**Cycles.** Loops often call over a few signatures in turn (a loss and a vector of metrics; each
parameter's gradient). The ranks keep the signatures they agreed, each with its message (up to
:data:`SIGNATURES_KEPT`, their windows within the node's bound on kept windows,
:attr:`.shm.NodeGroup.keep_bytes`), and the last calls' signatures: once those are one sequence
twice over, the shortest such (:meth:`OneTensor._learn`), every rank expects the calls to go round
it, and the agreed signature steps to the sequence's next one after each call. A call that is
the expected one is a hit, one message as above; any other is a miss in the expected one's
message, negotiated as above, and the ranks look again for a cycle in the calls made. Every rank
sees the same calls agreed, so all step alike and expect the same message.

**Join.** A rank in :meth:`.ops.TensorOps.join` cannot know whether the others' next call
comes here or to a header round, so it posts both: its header, and here a message of the
agreed length flagged :data:`JOINED` (:meth:`start_joined`), its values zeros: a start of
the agreed signature's message where it goes in one, else an ``MPI_Iallreduce`` of the flag.
That is why the flag-carrying MPI messages are persistent or nonblocking, each kind where
every rank uses it (MPI matches a persistent collective only with persistent ones, a
nonblocking one only with nonblocking ones). The others see a miss and negotiate with it; a
joined rank's signature is none, and every rank then takes the general path, which the
joined rank answers. The flags sum to the communicator's size only where every rank has
joined.

The waits are watched: a node-shared round's as :meth:`.shm.NodeAllreduce.wait` watches it; the
nonblocking ones, and the persistent one where ranks wait by
polling (the communicator's ``wait_policy`` ``"spin"``: a core each; a few tests, then), by
the communicator's polled wait, which raises :class:`CommTimeout` past the timeout; the
blocking one, and the persistent one where ranks yield their cores (``"yield"``, the default
where ranks share cores: ``MPI_Wait``, as MPI's own wait gives the core to the ranks it waits
for sooner than a poll from Python), by its watchdog thread (:meth:`Communicator.blocking`),
which aborts. A :class:`CommTimeout` leaves its request or round started (MPI can neither cancel nor
free a started collective, and the late ranks may still meet either): later calls here (and a
join) raise :class:`CommTimeout` naming it, starting nothing, until it has completed as a hit
on every rank (the ranks in step again: calls go on), e.g. where the late ranks met it while
this rank moved MPI along; a node-shared round left started is moved along by a thread of
its own (:meth:`NodeMessage.drive`), and until it completes it holds back the communicator's
later node-shared sums between nodes, whose exchanges are posted in start order. On a
communicator whose waits drive other work (:attr:`Communicator.interrupts`, e.g. abs-sgd's
node-shared round, set alike on every rank) calls take the general path with no check of
their own, as before this path existed: a rank blocked in MPI would not drive that work for
the others.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from mpi4py import MPI

from ..errors import CommTimeout, TensorMismatchError
from .communicator import Communicator
from .progress import PROGRESS_INTERVAL_S, threads_multiple
from .shm import KEEP_BYTES, KeptWindows, NodeAllreduce, WindowLayout, node_group

if TYPE_CHECKING:
    from .ops import TensorOps

#: The dtypes this path sums as they are (MPI's own arithmetic), with their numpy and MPI twins.
FAST_DTYPES: dict[torch.dtype, tuple[type[np.floating[Any]], MPI.Datatype]] = {
    torch.float32: (np.float32, MPI.FLOAT),
    torch.float64: (np.float64, MPI.DOUBLE),
}
#: Tensors up to this many bytes travel with the flag in one MPI message (copied into it); larger
#: ones are summed from where they lie, after the flag's own allreduce.
INLINE_MAX_BYTES = 4 * 1024 * 1024

SUM = "MPI_Iallreduce (one tensor)"
CHECK = "MPI_Iallreduce (one tensor's signature check)"

#: (dtype, shape, reduction, prescale, postscale): what the ranks must agree on.
Signature = tuple[torch.dtype, torch.Size, str, float, float]
#: A signature the ranks agreed, how its calls go, and its element count.
Agreed = tuple[Signature, str, int]
#: How many agreed signatures a communicator keeps with their messages (a cycle of calls with more is
#: not learned: its calls are agreed each time).
SIGNATURES_KEPT = 64
#: How many of the last calls' signatures are kept to find a cycle in (twice the longest cycle learned).
HISTORY = 2 * SIGNATURES_KEPT
#: How a signature's calls go: its values with the flag in one MPI message or in one node-shared sum,
#: after the flag, or the general path after it.
INLINE, NODE, SEPARATE, GENERAL = "inline", "node", "separate", "general"
#: The flag of a rank in :meth:`.ops.TensorOps.join` (a miss's is the communicator's size + 1, a hit's 0).
JOINED = 1
#: Tests of a started message before the polled wait (with its clock reads and interrupt walk) begins,
#: where every rank of the machine has a core of its own (else MPI's blocking wait: :meth:`OneTensor._start`).
FIRST_TESTS = 32


class OneTensor:
    """A communicator's agreed signature and the communicator its sums run on (one per communicator)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.sums = comm.split(0, name=("mpisolve.onetensor", "sums"))
        #: The signature every rank agreed last, how its calls go, and its element count.
        self.agreed: Agreed | None = None
        #: The agreed signature's message where its calls go in one (inline or node-shared; every rank
        #: holds one alike).
        self.message: Message | None = None
        #: A miss's flag: flags sum to the communicator's size only where every rank has joined.
        self.miss = comm.size + 1
        self._flag = np.zeros(1, dtype=np.int64)
        self._buffer = np.empty(0, dtype=np.float32)  # see _kept
        self._joined = self._flag  # a joined rank's message (see start_joined)
        #: The watchdog of the blocking sums (:meth:`Communicator.blocking`), kept: armed for each call.
        self._watchdog = comm.blocking(SUM)
        self.group = node_group(comm)
        #: Tensors of at least this many bytes go through a node-shared sum where one applies (its one-shot
        #: crossover); smaller ones, and every one where none applies, through MPI.
        self.node_min_bytes = sys.maxsize if self.group is None else self.group.one_shot_min_bytes
        #: Tensors up to this many bytes go inline with MPI (:data:`INLINE_MAX_BYTES`; the same on every rank).
        self.inline_max_bytes = INLINE_MAX_BYTES
        #: The signatures agreed, each with its message, kept for when the ranks agree it again (a node-shared
        #: message's window its own: apart from the group's, :attr:`.shm.NodeGroup.kept`).
        self.entries: KeptWindows[Agreed, Entry] = KeptWindows(
            KEEP_BYTES if self.group is None else self.group.keep_bytes, SIGNATURES_KEPT
        )
        #: The last calls' signatures, in order (:meth:`_learn`; up to when a cycle was found); the cycle they
        #: repeat, the calls made along it since (the next one's place in it: that count modulo its length),
        #: and whether it has more than one signature.
        self._history: list[Agreed] = []
        self._cycle: list[Agreed] = []
        self._made = 0
        self._stepping = False
        #: What timed out here, the request it left started (None: the negotiation's) and the agreed
        #: message, set aside: no later call runs here until that call completed as a hit everywhere.
        self.stuck: tuple[str, Started | None, Message | None] | None = None
        #: The communicator's checked collectives, once made (they set it): calls started there come before a
        #: call made here directly (``mpisolve.allreduce``).
        self.ops: TensorOps | None = None
        comm.on_free(self._free)
        #: Whether ranks yield their cores while they wait (they share them, or were asked to): then a
        #: hit's message is waited for by MPI's own blocking wait (under the watchdog thread), not polled.
        self._blocking_wait = comm.wait_policy == "yield"

    def mode(self, tensor: torch.Tensor, op: str) -> str:
        """How this rank's ``tensor`` can go (the ranks agree on it by negotiating)."""
        nbytes = tensor.nbytes
        if (
            op not in ("sum", "average")
            or tensor.dtype not in FAST_DTYPES
            or tensor.device.type != "cpu"
            or not tensor.is_contiguous()
            or self.comm.stage_all
        ):
            return GENERAL
        if (
            0 < nbytes
            and self.node_min_bytes <= nbytes
            and self.entries.fits(self._window_bytes(tensor.numel(), tensor.dtype))
        ):
            return NODE
        return INLINE if nbytes <= self.inline_max_bytes else SEPARATE

    def allreduce(self, tensor: torch.Tensor, op: str, scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor | None:
        """The sum or average of ``tensor`` (``scales``: multiplied by the first before, by the second
        after), or None where the general path is to reduce it (the ranks agreed on that); raises alike
        on every rank when the ranks' signatures differ."""
        hit = self.message
        # A hit, told by comparing with the agreed values as they are (the same test as mode()'s and
        # the signature's, which the agreed inline signature passed): no tuple built, no lookup.
        if (
            hit is not None
            and tensor.dtype is hit.dtype
            and tensor.shape == hit.shape
            and op == hit.op
            and scales == hit.scales
            and tensor.is_cpu
            and tensor.is_contiguous()
            and not self.comm.stage_all
            and not self.comm.has_interrupts()
        ):
            self._send(hit, tensor, scales[0])
            if hit.flags[0] == 0:
                self._called()
                return self._result(hit, op, scales[1])
            return self._settle(tensor, op, scales, self.mode(tensor, op))  # another rank missed
        if self.stuck is not None:
            self._resume()  # raises unless the call that timed out here has since completed as a hit everywhere
            return self.allreduce(tensor, op, scales)
        if self.comm.has_interrupts():
            return None  # no blocking call here: the general path, as before this path existed
        mode = self.mode(tensor, op)
        agreed = self.agreed
        if agreed is None:
            self._flags(self.miss)  # nothing agreed: every rank misses (a joined rank's message matches it)
        elif hit is not None:  # the agreed signature goes in one message and this call is not it: a miss
            hit.writable()
            hit.flag[0] = self.miss
            self._start(hit)
        elif self._flags(0 if agreed[:2] == ((tensor.dtype, tensor.shape, op, *scales), mode) else self.miss) == 0:
            self._called()
            return None if agreed[1] == GENERAL else self._separate(tensor, op, scales)
        return self._settle(tensor, op, scales, mode)

    def _settle(self, tensor: torch.Tensor, op: str, scales: tuple[float, float], mode: str) -> torch.Tensor | None:
        """After a miss (every rank saw it): negotiate, then reduce ``tensor`` the way the ranks agreed."""
        mode = self._negotiate((tensor.dtype, tensor.shape, op, *scales), mode, tensor.numel())
        self._leave_cycle()  # before the call, so that a timeout's resumption (_called) learns it as here
        agreed = self.agreed
        if mode in (INLINE, NODE):
            hit = self.message
            assert hit is not None and agreed is not None  # made by the negotiation
            self._send(hit, tensor, scales[0])
            assert hit.flags[0] == 0  # every rank sent the agreed signature
            self._learn(agreed)
            return self._result(hit, op, scales[1])
        if agreed is not None:  # every rank works: the agreed signature's call, by the general path or apart
            self._learn(agreed)
        return self._separate(tensor, op, scales) if mode == SEPARATE else None

    def _negotiate(self, mine: Signature | None, mode: str, numel: int) -> str:
        """Every rank's signature (None: joined) gathered: raises alike on every rank where the working
        ranks' differ; else the mode every rank takes from now (the general one while a rank has joined)."""
        view = None if mine is None else (str(mine[0]), tuple(mine[1]), *mine[2:], mode)
        try:
            views = self.sums.allgather_object(view)
        except CommTimeout:
            self.timed_out("the one-tensor signature negotiation", None)
            raise
        working = [(r, v) for r, v in enumerate(views) if v is not None]
        if len(working) < len(views):
            self._agree(None)  # the joined ranks answer the general path only
            return GENERAL
        differ = [r for r, v in working if v[:5] != views[0][:5]]
        if differ:
            raise TensorMismatchError(
                f"mpisolve allreduce: the ranks' shapes, dtypes, reductions or scales differ: rank 0 has "
                f"{_shown(views[0])}, rank(s) {','.join(map(str, differ))} have {_shown(views[differ[0]])}"
            )
        modes = {v[5] for _, v in working}
        agreed_mode = modes.pop() if len(modes) == 1 else GENERAL
        assert mine is not None  # every rank works
        self._agree((mine, agreed_mode, numel))
        return agreed_mode

    def _agree(self, agreed: Agreed | None) -> None:
        """Make ``agreed`` the agreed signature, its message kept or made (every rank alike, so that their
        persistent requests and windows pair up); None: none agreed, and nothing learned."""
        self.message, self.agreed = None, None
        if agreed is None:
            self._forget()
            return
        nbytes = self._window_bytes(agreed[2], agreed[0][0]) if agreed[1] == NODE else 0
        try:
            entry = self.entries.get([(agreed, nbytes)], self._entry)[0]
        finally:  # also where making the message failed, after others were freed for room
            if any(key not in self.entries.by_key for key in self._cycle):
                self._forget()  # a signature of the cycle had its message freed for room
        self.message, self.agreed = entry.message, agreed

    def _entry(self, agreed: Agreed) -> Entry:
        """A newly agreed signature and its message (collective where it has one)."""
        signature, mode, numel = agreed
        if mode == INLINE:
            return Entry(InlineMessage(signature, numel, self.sums.comm))
        if mode == NODE:
            assert self.group is not None  # NODE is agreed only where a node-shared sum applies
            return Entry(NodeMessage(signature, numel, NodeAllreduce(self.group, numel + 1, signature[0])))
        return Entry(None)

    def _window_bytes(self, numel: int, dtype: torch.dtype) -> int:
        """The bytes of a node-shared message's window for ``numel`` values of ``dtype`` (and the flag)."""
        return sys.maxsize if self.group is None else WindowLayout.of(self.group, numel + 1, dtype).total

    # ---------------------------------------------------------------- cycles
    def _called(self) -> None:
        """After a call of the agreed signature that every rank made (no negotiation): along a cycle, on
        to its next signature; else learn the call."""
        if self._cycle:
            self._made += 1
            if self._stepping:
                self.agreed = self._cycle[self._made % len(self._cycle)]
                self.message = self.entries.by_key[self.agreed].message
        else:
            assert self.agreed is not None
            self._learn(self.agreed)

    def _learn(self, agreed: Agreed) -> None:
        """Note a completed call of ``agreed`` (every rank alike), and look for a cycle.

        Once the last calls' signatures are one sequence twice (the shortest such), each call's message
        is the sequence's next signature's: a hit where the call is it, so that a loop over a few tensors
        (a metric and a vector; each parameter in turn) is agreed while the ranks learn it, twice round,
        and not at every call. A call off the cycle is a miss: the ranks negotiate, and look again, on
        the calls made (the cycle's since it was found, then this one), for a longer cycle."""
        history = self._history
        history.append(agreed)
        del history[:-HISTORY]
        for period in range(1, len(history) // 2 + 1):
            cycle = history[-period:]
            if (
                history[-1] == history[-1 - period]
                and history[-2 * period : -period] == cycle
                and all(key in self.entries.by_key for key in cycle)  # each with its message kept
            ):
                self._cycle, self._made = cycle, 0
                self._stepping = period > 1
                if self._stepping:  # the next call is the cycle's first
                    self.agreed = self._cycle[0]
                    self.message = self.entries.by_key[self.agreed].message
                return

    def _leave_cycle(self) -> None:
        """After a miss: no cycle, the calls made along it since it was found going on the history."""
        cycle, made = self._cycle, self._made
        if cycle:
            self._history += [cycle[i % len(cycle)] for i in range(max(0, made - HISTORY), made)]
            self._forget(keep_history=True)

    def _forget(self, keep_history: bool = False) -> None:
        """No cycle known (nor, unless ``keep_history``, any call): the next call is expected to be the last agreed."""
        self._cycle, self._made, self._stepping = [], 0, False
        if not keep_history:
            self._history = []

    def _free(self) -> None:
        """Release the kept messages and their windows (collective; run by ``comm.free()``)."""
        self._agree(None)
        self.entries.free()

    # ------------------------------------------------------------------ join
    def start_joined(self) -> Started | None:
        """A joined rank's part in the others' next call here (:meth:`.ops.TensorOps.join`), started:
        the message they send, flagged :data:`JOINED`, so that they negotiate with it. None where
        calls here take the general path (which join answers)."""
        if self.comm.has_interrupts():
            return None
        if self.stuck is not None:
            self._resume()
        hit = self.message
        if self.comm.has_queued():
            self.comm.flush(SUM)
        if hit is not None:  # the others' message is the agreed signature's: so is this, with zeros
            hit.writable()
            hit.values[:] = 0
            hit.flag[0] = JOINED
            self._joined = hit.flags
            hit.start()
            return hit.request
        self._joined = np.array([JOINED], dtype=np.int64)
        return self.sums.comm.Iallreduce(MPI.IN_PLACE, [self._joined, MPI.INT64_T], MPI.SUM)

    def answer_joined(self) -> bool:
        """After :meth:`start_joined`'s message completed: whether the others called (this rank then
        negotiates with them: they take the general path), not every rank joining."""
        if self._joined[-1] == self.comm.size * JOINED:
            return False
        self._negotiate(None, GENERAL, 0)
        return True

    # ------------------------------------------------------------- timeouts
    def timed_out(self, what: str, request: Started | None) -> None:
        """Note that ``what`` timed out here (:class:`CommTimeout`), leaving ``request`` started.

        MPI can neither cancel nor free a started collective, nor start a persistent one again
        before it completes, and the other ranks may still join it: until it has completed as a
        hit on every rank (:meth:`_resume`), calls here raise instead of starting anything (the
        agreed message is set aside, out of the hit test's reach). A node-shared round moves only
        while its ranks drive it (this rank's share of the sum; across nodes, the leader's exchange
        and publication), not with MPI's progress: a thread drives this rank's part until the round
        completes (:meth:`NodeMessage.drive`), so that the late ranks can still complete it."""
        self.stuck = (what, request, self.message)
        self.message = None
        if isinstance(request, NodeMessage):
            request.drive()

    def _resume(self) -> None:
        """Go on after a timeout where the call that timed out has since completed with every rank's
        flag 0 (every rank returned from it, as this rank's exception did: the ranks are in step);
        else raise :class:`CommTimeout` naming it."""
        assert self.stuck is not None
        what, request, message = self.stuck
        if message is not None and request is message.request and request.Test() and message.flags[0] == 0:
            self.message, self.stuck = message, None
            self._called()  # as the other ranks did after it
            return
        done = request is not None and request.Test()
        state = "completed out of step with the other ranks" if done else "is still in flight"
        raise CommTimeout(
            f"mpisolve: allreduce of one tensor cannot run on rank {self.comm.rank} of {self.comm.size}: "
            f"{what} timed out here earlier and {state} (MPI can neither cancel nor free a started "
            "collective); the job cannot go on"
        )

    # ------------------------------------------------------------------ sums
    def _send(self, hit: Message, tensor: torch.Tensor, prescale: float) -> None:
        """Sum ``tensor``'s values (prescaled) and the flag 0 in the agreed signature's message."""
        if tensor is not hit.source or tensor.data_ptr() != hit.pointer:
            hit.source, hit.pointer, hit.host = tensor, tensor.data_ptr(), _host(tensor)
        hit.writable()
        if prescale == 1.0:
            hit.values[:] = hit.host
        else:
            np.multiply(hit.host, prescale, out=hit.values)
        hit.flag[0] = 0
        self._start(hit)

    def _start(self, hit: Message) -> None:
        """Start the agreed signature's message and wait for it. A node-shared sum waits as it does
        (:meth:`.shm.NodeAllreduce.wait`). An MPI persistent allreduce, where every rank has a core
        of its own: a few tests (a small message is often in by then), then the communicator's polled,
        watchdogged wait; where ranks share cores, MPI's own ``MPI_Wait`` under the watchdog thread,
        which yields the core to the ranks it waits for sooner than a poll from Python does."""
        if self.comm.has_queued():
            self.comm.flush(SUM)
        hit.start()
        if isinstance(hit, NodeMessage):
            try:
                hit.node_sum.wait(SUM)
            except CommTimeout:
                self.timed_out(SUM, hit.request)
                raise
            return
        assert isinstance(hit, InlineMessage)
        request = hit.persistent
        if self._blocking_wait:
            with self._watchdog.arm(SUM, None):
                request.Wait()
            return
        for _ in range(FIRST_TESTS):
            if request.Test():
                return
        self._wait(request, SUM)

    def _wait(self, request: MPI.Request, what: str) -> None:
        """The communicator's polled, watchdogged wait for ``request``, noted where it times out."""
        try:
            self.comm.wait_for(request.Test, what)
        except CommTimeout:
            self.timed_out(what, request)
            raise

    def _result(self, hit: Message, op: str, postscale: float) -> torch.Tensor:
        """The sum in the kept message, copied out into a new tensor (averaged, postscaled)."""
        values = np.divide(hit.sums, hit.divisor) if op == "average" else hit.sums.copy()
        if postscale != 1.0:
            values *= postscale
        return torch.from_numpy(values if hit.shaped is None else values.reshape(hit.shaped))

    def _flags(self, flag: int) -> int:
        """The sum of every rank's ``flag`` (0: a hit), in one allreduce."""
        self._flag[0] = flag
        self._sum(CHECK, [self._flag, MPI.INT64_T])
        return int(self._flag[0])

    def _sum(self, what: str, spec: list[Any], out: list[Any] | None = None) -> None:
        """One allreduce (sum) of ``spec`` (in place, or into ``out``), watchdogged.

        A flag alone (in place) is an ``MPI_Iallreduce``, which a joined rank's
        (:meth:`start_joined`) can match, waited for at once by the communicator's polled wait
        (past the timeout, :class:`CommTimeout` on this rank); the values after the flags agreed
        (every rank working) one blocking ``MPI_Allreduce`` under the watchdog thread."""
        if self.comm.has_queued():
            self.comm.flush(what)
        if out is None:
            self._wait(self.sums.comm.Iallreduce(MPI.IN_PLACE, spec, MPI.SUM), what)
            return
        with self._watchdog.arm(what, None):
            self.sums.comm.Allreduce(spec, out, MPI.SUM)

    def _kept(self, dtype: torch.dtype, numel: int) -> np.ndarray[Any, Any]:
        """This communicator's buffer of ``numel`` elements of ``dtype`` for separate sums, kept for the
        next call: MPI moves messages between buffers it has seen before faster than between new ones."""
        np_dtype = FAST_DTYPES[dtype][0]
        if self._buffer.dtype != np_dtype or self._buffer.size != numel:
            self._buffer = np.empty(numel, dtype=np_dtype)
        return self._buffer

    def _separate(self, tensor: torch.Tensor, op: str, scales: tuple[float, float]) -> torch.Tensor:
        """Sum ``tensor`` from where it lies (a prescaled copy) into the kept buffer, and copy it out
        (every rank's signature agreed)."""
        values = self._kept(tensor.dtype, tensor.numel())
        mpi_type = FAST_DTYPES[tensor.dtype][1]
        host = _host(tensor) if scales[0] == 1.0 else _host(tensor) * scales[0]
        self._sum(SUM, [host, mpi_type], [values, mpi_type])
        return _result(values.copy(), op, self.comm.size, tensor.shape, scales[1])


class Entry:
    """An agreed signature's message (None: its calls go apart, or by the general path), kept with it
    (:class:`.shm.KeptWindows`, a :class:`.shm.Windowed`)."""

    def __init__(self, message: Message | None) -> None:
        self.message = message

    @property
    def nbytes(self) -> int:
        return 0 if self.message is None else self.message.nbytes

    def free(self) -> None:
        if self.message is not None:
            self.message.free()


class Started(Protocol):
    """A started message, tested as an MPI request is (``Test``: whether it has completed)."""

    def Test(self) -> bool: ...  # noqa: N802 (MPI's name: an MPI request is one)


class Message:
    """An agreed signature whose calls go in one message: its values as they are (compared with each
    call's), and where this rank writes its values and flag before each start and reads their sums
    after. The last tensor sent and its memory as numpy are kept too, so that a call with it again
    makes no view."""

    values: np.ndarray[Any, Any]
    sums: np.ndarray[Any, Any]
    flag: np.ndarray[Any, Any]
    flags: np.ndarray[Any, Any]
    request: Started

    def __init__(self, signature: Signature, numel: int, ranks: int) -> None:
        self.dtype, self.shape, self.op = signature[0], signature[1], signature[2]
        self.scales = (signature[3], signature[4])
        self.numel = numel
        #: What an average divides the sums by: the ranks, as a scalar of the values' dtype (a division
        #: by it is the division by the int's, with no conversion of the int each call).
        self.divisor = FAST_DTYPES[self.dtype][0](ranks)
        self.shaped = None if len(self.shape) == 1 else tuple(self.shape)
        self.source: torch.Tensor | None = None
        self.pointer = 0
        self.host: np.ndarray[Any, Any] = np.empty(0)

    def writable(self) -> None:
        """Wait until ``values`` and ``flag`` may be written for the next start."""

    def start(self) -> None:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """The bytes of its node-shared window (0: none)."""
        return 0

    def free(self) -> None:
        """Let go of what the message holds (collective: every rank frees its messages alike)."""
        raise NotImplementedError


class InlineMessage(Message):
    """A message of MPI's: a kept buffer of the values and the flag with a persistent allreduce on it
    (``MPI_Allreduce_init``, made by every rank alike when they agree), started each call."""

    def __init__(self, signature: Signature, numel: int, comm: MPI.Intracomm) -> None:
        super().__init__(signature, numel, comm.Get_size())
        np_dtype, mpi_type = FAST_DTYPES[self.dtype]
        buffer: np.ndarray[Any, Any] = np.zeros(numel + 1, dtype=np_dtype)
        self.values = self.sums = buffer[:numel]
        self.flag = self.flags = buffer[numel:]
        self.persistent = comm.Allreduce_init(MPI.IN_PLACE, [buffer, mpi_type], MPI.SUM)
        self.request = self.persistent

    def start(self) -> None:
        self.persistent.Start()

    def free(self) -> None:
        """Free the persistent allreduce; one a timeout left started is kept instead (MPI frees no started
        request, and the late ranks may still meet it), with its buffer."""
        if self.persistent.Test():
            self.persistent.Free()
        else:
            _LEFT_STARTED.append(self)


class NodeMessage(Message):
    """A message through node-shared memory: a kept :class:`.shm.NodeAllreduce` of the values and the
    flag (one more element: across nodes one exchange, where a tally would add a second), started each
    call. The flags' sum is exact in either dtype wherever it is to be told apart: none of them is
    negative, so it is 0 only where all are, and a sum of the ranks' :data:`JOINED` flags is the size."""

    def __init__(self, signature: Signature, numel: int, op: NodeAllreduce) -> None:
        super().__init__(signature, numel, op.comm.size)
        self.node_sum = op
        self.values, self.flag = op.input.numpy()[:numel], op.input.numpy()[numel:]
        self.sums, self.flags = op.result.numpy()[:numel], op.result.numpy()[numel:]
        self.request = self
        #: Whether ``values`` is this rank's slot in the window, which the node's ranks may still read
        #: (the bandwidth path), not memory of the sum's own (copied in at the start: the latency path).
        self.in_window = not op.latency

    def writable(self) -> None:
        if self.in_window:
            self.node_sum.wait_writable(SUM)

    def start(self) -> None:
        self.node_sum.start()

    @property
    def nbytes(self) -> int:
        return self.node_sum.nbytes

    def free(self) -> None:
        """Free the node-shared sum, which completes a round in flight first, on every rank alike."""
        self.node_sum.free()

    def Test(self) -> bool:  # noqa: N802 (an MPI request's name: join and the timeouts test either alike)
        """Whether the round has completed (moving it along)."""
        return self.node_sum.poll()

    def drive(self) -> None:
        """Drive the round, which a timeout left started, from a thread of its own until it completes
        (every :data:`.progress.PROGRESS_INTERVAL_S`; the node group's lock orders it with this rank's
        other rounds). Its MPI calls, across nodes, need ``MPI_THREAD_MULTIPLE``: without it the round
        moves only when this rank tests it again (a later call here)."""
        if threads_multiple():
            threading.Thread(target=self._drive, name="mpisolve-onetensor-late-round", daemon=True).start()

    def _drive(self) -> None:
        while not self.Test():
            time.sleep(PROGRESS_INTERVAL_S)


def _host(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    """A contiguous CPU tensor's memory as a flat numpy array (no copy)."""
    host = (tensor.detach() if tensor.requires_grad else tensor).numpy()
    return host if host.ndim == 1 else host.reshape(-1)


def _result(values: np.ndarray[Any, Any], op: str, size: int, shape: torch.Size, postscale: float) -> torch.Tensor:
    if op == "average":
        np.divide(values, size, out=values)
    if postscale != 1.0:
        values *= postscale
    return torch.from_numpy(values if len(shape) == 1 else values.reshape(tuple(shape)))


def _shown(view: tuple[Any, ...]) -> str:
    scales = "" if view[3:5] == (1.0, 1.0) else f", prescale {view[3]:g}, postscale {view[4]:g}"
    return f"{view[0].replace('torch.', '')} {list(view[1])} ({view[2]}{scales})"


#: Messages whose persistent allreduce was left started by a timeout when their communicator was freed:
#: kept, since MPI may still write into their buffers.
_LEFT_STARTED: list[InlineMessage] = []

_STATES: weakref.WeakKeyDictionary[Communicator, OneTensor] = weakref.WeakKeyDictionary()


def one_tensor(comm: Communicator) -> OneTensor:
    """``comm``'s :class:`OneTensor` (made collectively on the first call)."""
    state = _STATES.get(comm)
    if state is None:
        state = _STATES[comm] = OneTensor(comm)
    return state
