"""An allreduce of one CPU tensor: its signature agreed once, then one MPI call a call.

``mpisolve.allreduce`` of one tensor and ``hvd.allreduce`` (each allreduce of one tensor that
:class:`.ops.TensorOps` starts, :class:`.ops.OneCall`) come here. The general path
(:func:`.collectives.allreduce`, or :mod:`.ops`' header round and data round) fuses, posts
nonblocking rounds and waits for them through the watchdog: per call costs that are several
times MPI's own latency for a few KiB. Here a sum or average of one float CPU tensor below
the one-shot crossover (:attr:`.shm.NodeGroup.one_shot_min_bytes`; any size where
node-shared sums do not apply) is checked across ranks once per signature (dtype, shape,
reduction, prescale and postscale factors), then each call is one ``MPI_Iallreduce``,
waited for at once, on a communicator of its own: of the values and one more element, a
*miss* flag, up to :data:`INLINE_MAX_BYTES`; above it, of the flag alone and then (one
blocking ``MPI_Allreduce``) of the tensor from where it lies. The message lands in a
buffer the communicator keeps for the next call and is copied out into the new result:
MPI moves messages between buffers it has seen before faster than into new memory each
call (docs/studies/node-aware.md).

**The check, kept cheap.** Every rank holds the same *agreed* signature (the last one every
rank negotiated, or none): it changes only after a negotiation, which every rank runs alike.
A call whose signature is the agreed one sends the flag 0 (with its values, inline); any
other call sends a miss (and, inline, as many elements as the agreed signature has, so
every rank's message has the same length; with none agreed, the flag alone). The flags'
sum is the same on every rank: 0 means every rank called with the agreed signature;
otherwise every rank negotiates: the ranks' signatures are gathered (one small
``allgather``), and where they differ every rank raises :class:`TensorMismatchError`
naming them, as the checked collectives of :mod:`.ops` do, and nothing hangs. Where they
agree, that signature becomes the agreed one. Where the agreed signature does not take
this path (a larger tensor, another reduction, a dtype MPI has no arithmetic for, a GPU or
non-contiguous tensor on some rank), each call sends only the flag before taking the
general path, so a rank that calls with another signature is still noticed.

**Join.** A rank in :meth:`.ops.TensorOps.join` cannot know whether the others' next call
comes here or to a header round, so it posts both: its header, and here a message of the
agreed length flagged :data:`JOINED` (:meth:`start_joined`). That is why the flag-carrying
messages are nonblocking (MPI matches a nonblocking collective only with nonblocking
ones). The others see a miss and negotiate with it; a joined rank's signature is none, and
every rank then takes the general path, which the joined rank answers. The flags sum to
the communicator's size only where every rank has joined.

The waits are watched: the nonblocking ones by the communicator's polled wait, which
raises :class:`CommTimeout` past the timeout, the blocking one by its watchdog thread
(:meth:`Communicator.blocking`), which aborts. On a communicator whose waits drive other
work (:attr:`Communicator.interrupts`, e.g. abs-sgd's node-shared round, set alike on
every rank) calls take the general path with no check of their own, as before this path
existed: a rank blocked in MPI would not drive that work for the others.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from ..errors import TensorMismatchError
from .communicator import Communicator
from .shm import node_group

#: The dtypes this path sums as they are (MPI's own arithmetic), with their numpy and MPI twins.
FAST_DTYPES: dict[torch.dtype, tuple[type[np.floating[Any]], MPI.Datatype]] = {
    torch.float32: (np.float32, MPI.FLOAT),
    torch.float64: (np.float64, MPI.DOUBLE),
}
#: Tensors up to this many bytes travel with the flag in one message (copied into it); larger
#: ones are summed from where they lie, after the flag's own allreduce.
INLINE_MAX_BYTES = 64 * 1024

SUM = "MPI_Iallreduce (one tensor)"
CHECK = "MPI_Iallreduce (one tensor's signature check)"

#: (dtype, shape, reduction, prescale, postscale): what the ranks must agree on.
Signature = tuple[torch.dtype, torch.Size, str, float, float]
#: How a signature's calls go: its values with the flag, after the flag, or the general path after it.
INLINE, SEPARATE, GENERAL = "inline", "separate", "general"
#: The flag of a rank in :meth:`.ops.TensorOps.join` (a miss's is the communicator's size + 1, a hit's 0).
JOINED = 1


class OneTensor:
    """A communicator's agreed signature and the communicator its sums run on (one per communicator)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.sums = comm.split(0, name=("mpisolve.onetensor", "sums"))
        #: The signature every rank agreed last, how its calls go, and its element count.
        self.agreed: tuple[Signature, str, int] | None = None
        #: A miss's flag: flags sum to the communicator's size only where every rank has joined.
        self.miss = comm.size + 1
        self._flag = np.zeros(1, dtype=np.int64)
        self._buffer = np.empty(0, dtype=np.float32)  # see _kept
        self._joined = self._flag  # a joined rank's message (see start_joined)
        #: The watchdog of the blocking sums (:meth:`Communicator.blocking`), kept: armed for each call.
        self._watchdog = comm.blocking(SUM)
        group = node_group(comm)
        #: Tensors below this many bytes take this path (where node-shared sums apply: their crossover).
        self.max_bytes = sys.maxsize if group is None else group.one_shot_min_bytes

    def mode(self, tensor: torch.Tensor, op: str) -> str:
        """How this rank's ``tensor`` can go (the ranks agree on it by negotiating)."""
        nbytes = tensor.nbytes
        if (
            op not in ("sum", "average")
            or tensor.dtype not in FAST_DTYPES
            or tensor.device.type != "cpu"
            or not tensor.is_contiguous()
            or nbytes >= self.max_bytes
            or self.comm.stage_all
        ):
            return GENERAL
        return INLINE if nbytes <= INLINE_MAX_BYTES else SEPARATE

    def allreduce(self, tensor: torch.Tensor, op: str, scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor | None:
        """The sum or average of ``tensor`` (``scales``: multiplied by the first before, by the second
        after), or None where the general path is to reduce it (the ranks agreed on that); raises alike
        on every rank when the ranks' signatures differ."""
        if self.comm.has_interrupts():
            return None  # no blocking call here: the general path, as before this path existed
        mine: Signature = (tensor.dtype, tensor.shape, op, *scales)
        mode = self.mode(tensor, op)
        agreed = self.agreed
        if agreed is None:
            self._flags(self.miss)  # nothing agreed: every rank misses (a joined rank's message matches it)
        else:
            signature, agreed_mode, numel = agreed
            hit = signature == mine and mode == agreed_mode
            if agreed_mode == INLINE:
                out = self._inline(tensor if hit else None, signature[0], numel, op, scales)
                if out is not None:
                    return out
            elif self._flags(0 if hit else self.miss) == 0:
                return None if agreed_mode == GENERAL else self._separate(tensor, op, scales)
        mode = self._negotiate(mine, mode, tensor.numel())
        if mode == INLINE:
            out = self._inline(tensor, tensor.dtype, tensor.numel(), op, scales)
            assert out is not None  # every rank sent the agreed signature
            return out
        return self._separate(tensor, op, scales) if mode == SEPARATE else None

    def _negotiate(self, mine: Signature | None, mode: str, numel: int) -> str:
        """Every rank's signature (None: joined) gathered: raises alike on every rank where the working
        ranks' differ; else the mode every rank takes from now (the general one while a rank has joined)."""
        view = None if mine is None else (str(mine[0]), tuple(mine[1]), *mine[2:], mode)
        views = self.sums.allgather_object(view)
        working = [(r, v) for r, v in enumerate(views) if v is not None]
        if len(working) < len(views):
            self.agreed = None  # the joined ranks answer the general path only
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
        self.agreed = (mine, agreed_mode, numel)
        return agreed_mode

    # ------------------------------------------------------------------ join
    def start_joined(self) -> MPI.Request | None:
        """A joined rank's part in the others' next call here (:meth:`.ops.TensorOps.join`), posted:
        the message they send, flagged :data:`JOINED`, so that they negotiate with it. None where
        calls here take the general path (which join answers)."""
        if self.comm.has_interrupts():
            return None
        agreed = self.agreed
        if agreed is not None and agreed[1] == INLINE:
            dtype, numel = agreed[0][0], agreed[2]
            self._joined = np.zeros(numel + 1, dtype=FAST_DTYPES[dtype][0])
            spec = [self._joined, FAST_DTYPES[dtype][1]]
        else:
            self._joined = np.zeros(1, dtype=np.int64)
            spec = [self._joined, MPI.INT64_T]
        self._joined[-1] = JOINED
        if self.comm.has_queued():
            self.comm.flush(SUM)
        return self.sums.comm.Iallreduce(MPI.IN_PLACE, spec, MPI.SUM)

    def answer_joined(self) -> bool:
        """After :meth:`start_joined`'s message completed: whether the others called (this rank then
        negotiates with them: they take the general path), not every rank joining."""
        if self._joined[-1] == self.comm.size * JOINED:
            return False
        self._negotiate(None, GENERAL, 0)
        return True

    # ------------------------------------------------------------------ sums
    def _flags(self, flag: int) -> int:
        """The sum of every rank's ``flag`` (0: a hit), in one allreduce."""
        self._flag[0] = flag
        self._sum(CHECK, [self._flag, MPI.INT64_T])
        return int(self._flag[0])

    def _sum(self, what: str, spec: list[Any], out: list[Any] | None = None) -> None:
        """One allreduce (sum) of ``spec`` (in place, or into ``out``), watchdogged.

        A message with the flag (in place) is an ``MPI_Iallreduce``, which a joined rank's
        (:meth:`start_joined`) can match, waited for at once by the communicator's polled wait
        (past the timeout, :class:`CommTimeout` on this rank); the values after the flags agreed
        (every rank working) one blocking ``MPI_Allreduce`` under the watchdog thread."""
        if self.comm.has_queued():
            self.comm.flush(what)
        if out is None:
            self.comm.wait_for(self.sums.comm.Iallreduce(MPI.IN_PLACE, spec, MPI.SUM).Test, what)
            return
        with self._watchdog.arm(what, None):
            self.sums.comm.Allreduce(spec, out, MPI.SUM)

    def _kept(self, dtype: torch.dtype, numel: int) -> np.ndarray[Any, Any]:
        """This communicator's message buffer of ``numel`` elements of ``dtype``, kept for the next call:
        MPI moves messages between buffers it has seen before faster than between new ones."""
        np_dtype = FAST_DTYPES[dtype][0]
        if self._buffer.dtype != np_dtype or self._buffer.size != numel:
            self._buffer = np.empty(numel, dtype=np_dtype)
        return self._buffer

    def _inline(
        self, tensor: torch.Tensor | None, dtype: torch.dtype, numel: int, op: str, scales: tuple[float, float]
    ) -> torch.Tensor | None:
        """Sum ``tensor``'s values (None: a miss, as many elements of ``dtype``) and the miss flag
        in one message; the sum (averaged for ``op="average"``), or None where some rank missed."""
        buffer = self._kept(dtype, numel + 1)
        if tensor is None:
            buffer[numel] = self.miss
        else:
            buffer[:numel] = _host(tensor)
            if scales[0] != 1.0:
                buffer[:numel] *= scales[0]
            buffer[numel] = 0
        self._sum(SUM, [buffer, FAST_DTYPES[dtype][1]])
        if buffer[numel] != 0:
            return None
        assert tensor is not None  # every rank sent its values
        return _result(buffer[:numel].copy(), op, self.comm.size, tensor.shape, scales[1])

    def _separate(self, tensor: torch.Tensor, op: str, scales: tuple[float, float]) -> torch.Tensor:
        """Sum ``tensor`` from where it lies (a prescaled copy) into the kept buffer, and copy it out
        (every rank's signature agreed)."""
        values = self._kept(tensor.dtype, tensor.numel())
        mpi_type = FAST_DTYPES[tensor.dtype][1]
        host = _host(tensor) if scales[0] == 1.0 else _host(tensor) * scales[0]
        self._sum(SUM, [host, mpi_type], [values, mpi_type])
        return _result(values.copy(), op, self.comm.size, tensor.shape, scales[1])


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


_STATES: weakref.WeakKeyDictionary[Communicator, OneTensor] = weakref.WeakKeyDictionary()


def one_tensor(comm: Communicator) -> OneTensor:
    """``comm``'s :class:`OneTensor` (made collectively on the first call)."""
    state = _STATES.get(comm)
    if state is None:
        state = _STATES[comm] = OneTensor(comm)
    return state
