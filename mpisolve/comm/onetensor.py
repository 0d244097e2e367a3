"""``mpisolve.allreduce`` of one CPU tensor: its signature agreed once, then one blocking ``MPI_Allreduce`` a call.

The general path (:func:`.collectives.allreduce`) fuses, posts a nonblocking allreduce and
waits for it through the watchdog: per call costs that are several times MPI's own latency
for a few KiB. Here a sum or average of one tensor below the one-shot crossover
(:attr:`.shm.NodeGroup.one_shot_min_bytes`; any size where node-shared sums do not apply) is
checked across ranks once per signature (dtype, shape, reduction), then each call is one
blocking ``MPI_Allreduce`` on a communicator of its own: of the values and one more element,
a *miss* flag, up to :data:`INLINE_MAX_BYTES`; above it, of the flag alone and then of the
tensor from where it lies. The message lands in a buffer the communicator keeps for the next
call and is copied out into the new result: MPI moves messages between buffers it has seen
before faster than into new memory each call (docs/studies/node-aware.md).

**The check, kept cheap.** Every rank holds the same *agreed* signature (the last one every
rank negotiated, or none): it changes only after a negotiation, which every rank runs alike.
A call whose signature is the agreed one sends the flag 0 (with its values, inline); any
other call sends 1 (and, inline, as many elements as the agreed signature has, so every
rank's message has the same length). The flag's sum is the same on every rank: 0 means
every rank called with the agreed signature; otherwise every rank negotiates: the ranks'
signatures are gathered (one small ``allgather``), and where they differ every rank raises
:class:`TensorMismatchError` naming them, as the checked collectives of :mod:`.ops` do, and
nothing hangs. Where they agree, that signature becomes the agreed one. Where the agreed
signature does not take this path (a larger tensor, a dtype MPI has no arithmetic for, a
non-contiguous tensor on some rank), each call sends only the flag before taking the
general path, so a rank that calls with another signature is still noticed.

The blocking calls are watched by the communicator's watchdog (:meth:`Communicator.blocking`),
which aborts past the timeout. On a communicator whose waits drive other work
(:attr:`Communicator.interrupts`, e.g. abs-sgd's node-shared round, set alike on every rank)
calls take the general path with no check of their own, as before this path existed: a rank
blocked in MPI would not drive that work for the others.
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

SUM = "MPI_Allreduce (mpisolve.allreduce)"
CHECK = "MPI_Allreduce (mpisolve.allreduce's signature check)"

#: (dtype, shape, reduction): what the ranks must agree on.
Signature = tuple[torch.dtype, torch.Size, str]
#: How a signature's calls go: its values with the flag, after the flag, or the general path after it.
INLINE, SEPARATE, GENERAL = "inline", "separate", "general"


class OneTensor:
    """A communicator's agreed signature and the communicator its sums run on (one per communicator)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.sums = comm.split(0, name=("mpisolve.onetensor", "sums"))
        #: The signature every rank agreed last, how its calls go, and its element count.
        self.agreed: tuple[Signature, str, int] | None = None
        self._flag = np.zeros(1, dtype=np.int64)
        self._buffer = np.empty(0, dtype=np.float32)  # see _kept
        #: The watchdog of the blocking calls (:meth:`Communicator.blocking`), kept: armed for each call.
        self._watchdog = comm.blocking(SUM)
        group = node_group(comm)
        #: Tensors below this many bytes take this path (where node-shared sums apply: their crossover).
        self.max_bytes = sys.maxsize if group is None else group.one_shot_min_bytes

    def mode(self, tensor: torch.Tensor) -> str:
        """How this rank's ``tensor`` can go (the ranks agree on it by negotiating)."""
        nbytes = tensor.nbytes
        if (
            tensor.dtype not in FAST_DTYPES
            or not tensor.is_contiguous()
            or nbytes >= self.max_bytes
            or self.comm.stage_all
        ):
            return GENERAL
        return INLINE if nbytes <= INLINE_MAX_BYTES else SEPARATE

    def allreduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor | None:
        """The sum or average of ``tensor`` (a CPU float tensor), or None where the general path
        is to reduce it (the ranks agreed on its signature then); raises alike on every rank when
        the ranks' signatures differ."""
        if self.comm.has_interrupts():
            return None  # no blocking call here: the general path, as before this path existed
        mine: Signature = (tensor.dtype, tensor.shape, op)
        mode = self.mode(tensor)
        agreed = self.agreed
        if agreed is not None:
            signature, agreed_mode, numel = agreed
            hit = signature == mine and mode == agreed_mode
            if agreed_mode == INLINE:
                out = self._inline(tensor if hit else None, signature[0], numel, op)
                if out is not None:
                    return out
            elif self._all_hit(hit):
                return None if agreed_mode == GENERAL else self._separate(tensor, op)
        views = self.sums.allgather_object((str(tensor.dtype), tuple(tensor.shape), op, mode))
        differ = [r for r, view in enumerate(views) if view[:3] != views[0][:3]]
        if differ:
            first = views[differ[0]]
            raise TensorMismatchError(
                f"mpisolve allreduce: the ranks' shapes, dtypes or reductions differ: rank 0 has "
                f"{_shown(views[0])}, rank(s) {','.join(map(str, differ))} have {_shown(first)}"
            )
        modes = {view[3] for view in views}
        mode = modes.pop() if len(modes) == 1 else GENERAL
        self.agreed = (mine, mode, tensor.numel())
        if mode == INLINE:
            out = self._inline(tensor, tensor.dtype, tensor.numel(), op)
            assert out is not None  # every rank sent the agreed signature
            return out
        return None if mode == GENERAL else self._separate(tensor, op)

    def _all_hit(self, hit: bool) -> bool:
        """Whether every rank's call has the agreed signature (one allreduce of the miss flags)."""
        self._flag[0] = 0 if hit else 1
        self._blocking_sum(CHECK, [self._flag, MPI.INT64_T])
        return bool(self._flag[0] == 0)

    def _blocking_sum(self, what: str, spec: list[Any], out: list[Any] | None = None) -> None:
        """One blocking ``MPI_Allreduce`` (sum) of ``spec`` (in place, or into ``out``), watchdogged."""
        if self.comm.has_queued():
            self.comm.flush(what)
        with self._watchdog.arm(what, None):
            self.sums.comm.Allreduce(MPI.IN_PLACE if out is None else spec, spec if out is None else out, MPI.SUM)

    def _kept(self, dtype: torch.dtype, numel: int) -> np.ndarray[Any, Any]:
        """This communicator's message buffer of ``numel`` elements of ``dtype``, kept for the next call:
        MPI moves messages between buffers it has seen before faster than between new ones."""
        np_dtype = FAST_DTYPES[dtype][0]
        if self._buffer.dtype != np_dtype or self._buffer.size != numel:
            self._buffer = np.empty(numel, dtype=np_dtype)
        return self._buffer

    def _inline(self, tensor: torch.Tensor | None, dtype: torch.dtype, numel: int, op: str) -> torch.Tensor | None:
        """Sum ``tensor``'s values (None: a miss, as many elements of ``dtype``) and the miss flag
        in one message; the sum (averaged for ``op="average"``), or None where some rank missed."""
        buffer = self._kept(dtype, numel + 1)
        if tensor is None:
            buffer[numel] = 1
        else:
            buffer[:numel] = _host(tensor)
            buffer[numel] = 0
        self._blocking_sum(SUM, [buffer, FAST_DTYPES[dtype][1]])
        if buffer[numel] != 0:
            return None
        assert tensor is not None  # every rank sent its values
        return _result(buffer[:numel].copy(), op, self.comm.size, tensor.shape)

    def _separate(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Sum ``tensor`` from where it lies into the kept buffer, and copy it out (every rank's signature agreed)."""
        values = self._kept(tensor.dtype, tensor.numel())
        mpi_type = FAST_DTYPES[tensor.dtype][1]
        self._blocking_sum(SUM, [_host(tensor), mpi_type], [values, mpi_type])
        return _result(values.copy(), op, self.comm.size, tensor.shape)


def _host(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    """A contiguous CPU tensor's memory as a flat numpy array (no copy)."""
    host = (tensor.detach() if tensor.requires_grad else tensor).numpy()
    return host if host.ndim == 1 else host.reshape(-1)


def _result(values: np.ndarray[Any, Any], op: str, size: int, shape: torch.Size) -> torch.Tensor:
    if op == "average":
        np.divide(values, size, out=values)
    return torch.from_numpy(values if len(shape) == 1 else values.reshape(tuple(shape)))


def _shown(view: tuple[str, tuple[int, ...], str, str]) -> str:
    return f"{view[0].replace('torch.', '')} {list(view[1])} ({view[2]})"


_STATES: weakref.WeakKeyDictionary[Communicator, OneTensor] = weakref.WeakKeyDictionary()


def one_tensor(comm: Communicator) -> OneTensor:
    """``comm``'s :class:`OneTensor` (made collectively on the first call)."""
    state = _STATES.get(comm)
    if state is None:
        state = _STATES[comm] = OneTensor(comm)
    return state
