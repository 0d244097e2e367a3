"""Collectives on tensors of any dtype, checked across ranks before any data moves.

``mpisolve.allgather`` (first dimensions may differ), ``broadcast``, ``alltoall`` (with
splits), ``reducescatter`` and ``allreduce`` of one tensor or a list, with the reductions
``sum``, ``average``, ``min``, ``max``, ``product`` (and ``adasum`` for floats), and
:func:`process_set`, a communicator of some ranks. Each is :meth:`TensorOps.start`
followed by :meth:`Pending.wait`; the Horovod layer (:mod:`mpisolve.horovod`) starts them
without waiting.

**The check.** Every call first gathers a fixed-size header from every rank (one
``MPI_Iallgather`` of 86 int64s on a communicator of its own): the operation, its
reduction, root, dtype, device, the shapes (a hash of all of them, the first 8 dimensions
of the first in clear), the name, and the per-rank sizes a gather or an all-to-all needs
(first dimensions, splits). Every rank sees every header, so every rank decides alike:
if they disagree, each raises :class:`TensorMismatchError` naming the ranks and what
differs, and no data round is posted (nothing hangs). Otherwise the data round runs on a
second communicator; a small CPU allreduce or broadcast has none: its values ride in the
headers (an allreduce's in every rank's, a broadcast's in the root's). Headers are posted
in call order; data rounds are posted in the same order (a call's data round waits for
every earlier call's), so calls may overlap freely.

**One tensor.** An allreduce of one tensor skips the header round: it is a
:class:`OneCall`, which :mod:`.onetensor` checks by the signature the ranks agreed once
(a flag in its one message) and which becomes a call of the general path where that says
so. It runs, in start order, when its rank waits for any call here: one call that
waits for every rank, which cannot run as it starts (Horovod's ranks may start calls
and wait for them later, in between starting others).

**Join.** :meth:`TensorOps.join` makes a rank that has run out of work answer the others'
calls until every rank has joined: it contributes the identity of the reduction to each
allreduce (zeros for a sum: an average is still divided by the number of ranks), and a
gather, broadcast, all-to-all or reduce-scatter while a rank has joined is an error on
the others. It returns the rank that joined last.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from ..errors import CommTimeout, TensorMismatchError
from .collectives import _adasum, _packed
from .collectives import allreduce as float_allreduce
from .communicator import Communicator, Posting, as_communicator, mpi_buffer
from .device import Stager
from .onetensor import one_tensor

KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "join")
REDUCTIONS = ("sum", "average", "min", "max", "product", "adasum")
#: Every dtype the collectives move; the position is the dtype's code in a header.
DTYPES = (
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
)
_MPI_REDUCE = {"sum": MPI.SUM, "average": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}
#: The dtype a reduction of each dtype runs in: MPI has no half-precision arithmetic, nor sums of bools.
_WIRE = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.bool: torch.uint8}
#: numpy's twins of the wire dtypes (an inline allreduce reduces the headers' values in numpy).
_NUMPY = {
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float32: np.float32,
    torch.float64: np.float64,
}
_MPI_TYPE = {
    torch.uint8: MPI.UINT8_T,
    torch.int8: MPI.INT8_T,
    torch.int16: MPI.INT16_T,
    torch.int32: MPI.INT32_T,
    torch.int64: MPI.INT64_T,
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
}

# Header layout (int64 slots), then META slots of per-rank sizes. The slots up to _JOINED come
# first, together: ranks that agree and have not joined have them equal (one comparison).
_KIND, _OP, _ROOT, _DEVICE, _COUNT, _DTYPE, _SIG, _META, _INLINE, _NAME, _JOINED = range(11)
_JOIN_ROUND, _NUMEL, _NDIM = range(11, 14)
_DIMS = 14
#: Dimensions of the first tensor a header carries in clear (for error messages).
CLEAR_DIMS = 8
_HEADER = _DIMS + CLEAR_DIMS
#: Per-rank sizes carried in the header itself; more take a round of their own. An allreduce
#: whose values fit in what its sizes leave of these slots carries them here too (inline).
META = 64
RECORD = _HEADER + META


def _hash(value: object) -> int:
    """A stable 63-bit hash (the same on every rank, unlike ``hash`` of a string)."""
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@functools.lru_cache(maxsize=4096)
def _name_hash(name: str) -> int:
    """A call's name as a header slot (names recur call after call: hashed once)."""
    return _hash(name)


class Pending:
    """One started collective: :meth:`test` says whether it is done, :meth:`wait` gives its result.

    The result is a tensor (a list for a grouped call; ``(tensor, received splits)`` for
    an all-to-all), or the error every rank raises when the ranks disagreed.
    """

    def __init__(self, ops: TensorOps, kind: str, name: str | None, header: np.ndarray[Any, Any]) -> None:
        self.ops = ops
        self.kind = kind
        self.name = name
        self.header = header
        self.gathered = np.empty(ops.comm.size * RECORD, dtype=np.int64)
        self.posting = Posting((), lambda: ops.hdr.comm.Iallgather(header, self.gathered))
        #: "header" (negotiating), "sizes" (per-rank sizes in a round of their own), "data", then done.
        self.stage = "header"
        self.sizes: Posting | None = None
        self.all_sizes = np.empty(0, dtype=np.int64)
        self.meta: list[int] = []
        #: Where values ride in the header (an allreduce's wire groups, a broadcast's tensors):
        #: ``(dtype, members, first byte, bytes)`` each; empty where they take a data round.
        self.layout: list[tuple[torch.dtype, list[int], int, int]] = []
        #: Set by the negotiation: the data round's postings and what completes the result.
        self.data: list[Posting] = []
        self.finish: Callable[[], Any] = lambda: None
        self.plan: Callable[[list[list[int]]], None] = lambda sizes: None
        self.error: Exception | None = None
        self.result: Any = None
        self.done = False
        #: Observers' view: "negotiating", "communicating", "done".
        self.phase = "negotiating"

    def test(self) -> bool:
        """Whether the collective has completed (moves every started collective along)."""
        self.ops.progress()
        return self.done

    def wait(self) -> Any:
        """Complete the collective (watchdogged) and return its result, or raise the ranks' common error."""
        what = f"{self.kind} {self.name!r}" if self.name else self.kind
        self.ops.comm.wait_for(self.test, what)
        if self.error is not None:
            raise self.error
        return self.result


class OneCall:
    """A started allreduce of one tensor, waiting its turn: :mod:`.onetensor`'s one call when run.

    It runs, in start order among this communicator's collectives, when this rank waits
    for any of them (or tests this one a second time): a call that waits for every rank,
    so it cannot run as it starts (a rank may start calls it never waits for before the
    others start theirs). Where the ranks' agreement says so, it becomes a :class:`Pending`
    of the general path (:attr:`general`) at that turn.
    """

    def __init__(
        self,
        ops: TensorOps,
        name: str | None,
        tensor: torch.Tensor,
        op: str,
        scales: tuple[float, float],
        out: Sequence[torch.Tensor] | None,
    ) -> None:
        self.ops = ops
        self.kind = "allreduce"
        self.name = name
        self.tensor, self.op, self.scales, self.out = tensor, op, scales, out
        self.general: Pending | None = None
        self.finish: Callable[[], Any] = lambda: None
        self.error: Exception | None = None
        self.result: Any = None
        self.done = False
        self._tested = False

    def test(self) -> bool:
        """Whether it has completed; the first test does not run it (tests do not block), later ones do."""
        if self.general is not None:
            return self.general.test()
        self.ops.progress(run=self._tested)
        self._tested = True
        return self.done

    def wait(self) -> Any:
        """Run it (and the calls started before it), and return its result, or raise the ranks' common error."""
        self._tested = True
        self.ops.comm.wait_for(self.test, self._what)
        if self.general is not None:
            return self.general.wait()
        if self.error is not None:
            raise self.error
        return self.result

    def _what(self) -> str:
        return f"allreduce {self.name!r}" if self.name else "allreduce"

    def run(self) -> Pending | None:
        """Its turn: reduced here (done), or the general path's :class:`Pending`, started, to take its place."""
        try:
            reduced = self.ops.one.allreduce(self.tensor, self.op, self.scales)
        except TensorMismatchError as err:
            self.error = err
            reduced = None
        if reduced is None and self.error is None:
            self.general = self.ops.start_general(self.tensor, self.op, self.scales, self.name, self.out)
            return self.general
        if reduced is not None:  # a partial, not a closure over self: no cycle keeps the result for the collector
            self.finish = functools.partial(_write_out, [self.tensor], [reduced], self.out)
        for observe in self.ops.observers:
            observe(self, "communicating")
        self.ops.complete(self)
        return None


#: A started collective: checked by a header round, or one tensor's allreduce.
Call = Pending | OneCall


class TensorOps:
    """The checked collectives of one communicator: headers, data rounds, join.

    Get it with :func:`tensor_ops` (one per communicator, made collectively on first use).
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.hdr = comm.dup(name="ops.header")
        self.data = comm.dup(name="ops.data")
        self.ctl = comm.dup(name="ops.barrier")
        #: Allreduces of one tensor (made here, collectively: a joined rank needs it too).
        self.one = one_tensor(comm)
        self.one.ops = self
        self._pending: list[Call] = []
        self._names: set[str] = set()
        self.rounds = 0  # header rounds negotiated here: the same count on every rank
        #: Called with (pending, phase) as a collective moves: "negotiating" (started),
        #: "communicating" (its data round posted), "done".
        self.observers: list[Callable[[Call, str], None]] = []

    # ------------------------------------------------------------------ starting
    def start(
        self,
        kind: str,
        tensors: Sequence[torch.Tensor],
        *,
        op: str = "sum",
        root: int = 0,
        splits: Sequence[int] | None = None,
        prescale: float = 1.0,
        postscale: float = 1.0,
        name: str | None = None,
        out: Sequence[torch.Tensor] | None = None,
    ) -> Call:
        """Start ``kind`` on ``tensors``.

        Every rank gives the same kind, op, root, dtypes and shapes, but for the first
        dimension of a gather or all-to-all. ``out``: an allreduce or a
        broadcast writes its results into these tensors (in place) instead of new ones.
        ``splits``: an all-to-all's rows for each rank (default: equal). Errors in this
        rank's own arguments raise at once; disagreements between ranks raise from
        :meth:`Pending.wait` on every rank.
        """
        self.progress(run=False)
        tensors = list(tensors)
        _check_local(kind, tensors, op, root, splits, self.comm.size)
        if name is not None and name in self._names:
            raise ValueError(f"mpisolve: a collective named {name!r} is already in flight on this rank")
        call: Call
        if kind == "allreduce" and len(tensors) == 1:
            call = OneCall(self, name, tensors[0], op, (prescale, postscale), out)
            self._launch(call, name)
            return call
        if kind == "alltoall" and splits is None:
            splits = [tensors[0].shape[0] // self.comm.size] * self.comm.size
        call = self.header_call(kind, tensors, op, root, splits, prescale, postscale, name, out)
        self._launch(call, name)
        self.hdr.start(call.posting)
        return call

    def allreduce_now(
        self, tensor: torch.Tensor, op: str, scales: tuple[float, float], name: str | None
    ) -> torch.Tensor | None:
        """A sum or average of one dense float tensor run at once, as :class:`OneCall` would at its turn.

        Only where nothing is in flight or watched here: its result (the ranks' disagreement raised
        on every rank), or None where it is to be started as a call instead (:meth:`start`).
        """
        if self._pending or self.observers or op not in ("sum", "average") or tensor.layout is not torch.strided:
            return None
        if not tensor.is_floating_point() or (name is not None and name in self._names):
            return None
        reduced = self.one.allreduce(tensor, op, scales)
        if reduced is not None:
            return reduced
        general = self.start_general(tensor, op, scales, name, None)
        self._launch(general, name)
        result: list[torch.Tensor] = general.wait()
        return result[0]

    def start_general(
        self, tensor: torch.Tensor, op: str, scales: tuple[float, float], name: str | None, out: Any
    ) -> Pending:
        """One tensor's allreduce on the general path, its header round started (as onetensor's agreement says)."""
        pending = self.header_call("allreduce", [tensor], op, 0, None, scales[0], scales[1], name, out)
        self.hdr.start(pending.posting)
        return pending

    def header_call(
        self,
        kind: str,
        tensors: list[torch.Tensor],
        op: str,
        root: int,
        splits: Sequence[int] | None,
        prescale: float,
        postscale: float,
        name: str | None,
        out: Sequence[torch.Tensor] | None,
    ) -> Pending:
        """A checked call of the general path (its header round not yet started)."""
        groups = _wire_groups(tensors) if kind == "allreduce" and op != "adasum" else None
        meta = self._meta(kind, tensors, groups, splits)
        header = np.zeros(RECORD, dtype=np.int64)
        first = tensors[0]
        dims = first.shape[:CLEAR_DIMS]
        header[: _DIMS + len(dims)] = (
            KINDS.index(kind),
            REDUCTIONS.index(op),
            root,
            first.device.type == "cuda",
            len(tensors),
            DTYPES.index(first.dtype),
            _signature(kind in ("allgather", "alltoall"), tensors),
            len(meta),
            0,  # no values inline (yet)
            0 if name is None else _name_hash(name),
            0,  # not joined
            0,
            sum(t.numel() for t in tensors),
            first.dim(),
            *dims,
        )
        pending = Pending(self, kind, name, header)
        pending.meta = meta
        if len(meta) <= META:
            header[_HEADER : _HEADER + len(meta)] = meta
            if first.device.type == "cpu" and (groups is not None or kind == "broadcast"):
                runs = list(groups.items()) if groups is not None else [(t.dtype, [i]) for i, t in enumerate(tensors)]
                pending.layout = _inline_layout(tensors, runs, len(meta))
            if pending.layout and (kind == "allreduce" or self.comm.rank == root):
                _inline(header, len(meta), tensors, pending.layout, prescale)
            if pending.layout:
                header[_INLINE] = pending.layout[-1][2] + pending.layout[-1][3]

        def plan(sizes: list[list[int]]) -> None:
            self._plan(pending, sizes, tensors, op, root, prescale, postscale, out)

        pending.plan = plan
        return pending

    def _launch(self, call: Call, name: str | None) -> None:
        if name is not None:
            self._names.add(name)
        self._pending.append(call)
        for observe in self.observers:
            observe(call, "negotiating")

    @staticmethod
    def _meta(
        kind: str,
        tensors: list[torch.Tensor],
        groups: dict[torch.dtype, list[int]] | None,
        splits: Sequence[int] | None,
    ) -> list[int]:
        """The per-rank sizes the others need.

        An allreduce's wire ``groups`` (for a joined rank), a gather's first dimensions, an
        all-to-all's splits.
        """
        if groups is not None:
            numels = [sum(tensors[i].numel() for i in members) for members in groups.values()]
            return [v for wire, n in zip(groups, numels) for v in (DTYPES.index(wire), n)]
        if kind == "allgather":
            return [t.shape[0] for t in tensors]
        if kind == "alltoall":
            assert splits is not None  # equal shares filled in by start
            return list(splits)
        return []

    # ----------------------------------------------------------------- progress
    def progress(self, run: bool = True) -> None:
        """Move every started collective along, in start order.

        Negotiate those whose headers have arrived, post their data rounds, complete those
        whose data has arrived; ``run``: run a :class:`OneCall` at its turn (else stop there).
        """
        for i, call in enumerate(self._pending):
            if isinstance(call, OneCall):
                if call.done:
                    continue
                if not run:
                    break
                general = call.run()
                if general is None:
                    continue
                self._pending[i] = call = general
            if call.stage == "header":
                if not self.hdr.test(call.posting):
                    break  # later calls' data rounds wait for this one's
                self._negotiated(call)
            if call.stage == "sizes":
                assert call.sizes is not None
                if not self.data.test(call.sizes):
                    break
                count = len(call.meta)
                self._planned(call, call.all_sizes.reshape(self.comm.size, count).tolist())
            if not call.done and all(self.data.test(p) for p in call.data):
                self.complete(call)
        if self._pending and self._pending[0].done:
            self._pending = [p for p in self._pending if not p.done]

    def _negotiated(self, pending: Pending) -> None:
        """The headers are in: fail alike on every rank, or go on to the sizes or data round."""
        self.rounds += 1
        headers = pending.gathered.reshape(self.comm.size, RECORD)
        problem = _disagreement(headers)
        if problem is not None:
            pending.error = TensorMismatchError(f"mpisolve {_label(pending)}: {problem}")
            pending.stage = "data"
            return
        count = len(pending.meta)
        if count <= META:
            self._planned(pending, headers[:, _HEADER : _HEADER + count].tolist())
            return
        mine = np.asarray(pending.meta, dtype=np.int64)
        pending.all_sizes = np.empty(self.comm.size * count, dtype=np.int64)
        pending.sizes = Posting((), lambda: self.data.comm.Iallgather(mine, pending.all_sizes))
        self.data.start(pending.sizes)
        pending.stage = "sizes"

    def _planned(self, pending: Pending, sizes: list[list[int]]) -> None:
        pending.stage = "data"
        try:
            pending.plan(sizes)
        except Exception as err:  # every rank saw the same headers: all fail alike
            pending.error = err
            pending.data = []
        for observe in self.observers:
            observe(pending, "communicating")

    def complete(self, pending: Call) -> None:
        """Its result made (or its error kept): done, its name free again."""
        if pending.error is None:
            try:
                pending.result = pending.finish()
            except Exception as err:
                pending.error = err
        pending.done = True
        if pending.name is not None:
            self._names.discard(pending.name)
        for observe in self.observers:
            observe(pending, "done")

    # ------------------------------------------------------------------ data
    def _plan(
        self,
        pending: Pending,
        sizes: list[list[int]],
        tensors: list[torch.Tensor],
        op: str,
        root: int,
        prescale: float,
        postscale: float,
        out: Sequence[torch.Tensor] | None,
    ) -> None:
        """Post the data round of a negotiated call and set how its result completes."""
        kind = pending.kind
        if kind == "allreduce" and pending.layout:
            pending.finish = self._inline_allreduce(pending, tensors, op, postscale, out)
        elif kind == "broadcast" and pending.layout:
            pending.finish = self._inline_broadcast(pending, tensors, root, out)
        elif kind == "allreduce" and op == "adasum":
            flats = [t.detach().reshape(-1).to(_WIRE.get(t.dtype, t.dtype), copy=True) for t in tensors]
            _adasum(flats, [[f.numel()] for f in flats], self.data)
            pending.finish = lambda: _write_out(tensors, [f.view(t.shape) for f, t in zip(flats, tensors)], out)
        elif kind == "allreduce":
            pending.data, pending.finish = self._allreduce(tensors, op, prescale, postscale, out)
        elif kind == "allgather":
            pending.data, pending.finish = self._allgather(tensors, sizes)
        elif kind == "broadcast":
            pending.data, pending.finish = self._broadcast(tensors, root, out)
        elif kind == "alltoall":
            pending.data, pending.finish = self._alltoall(tensors[0], sizes)
        else:
            pending.data, pending.finish = self._reducescatter(tensors, op, prescale, postscale)

    def _post(
        self, buffers: Sequence[torch.Tensor], post: Callable[..., MPI.Request], receives: bool = False
    ) -> tuple[Posting, list[Stager]]:
        """Start one MPI call on ``buffers`` (staged where the communicator says), in order."""
        stagers = [self.data.stager(b) for b in buffers]
        for i, s in enumerate(stagers):
            s.to_mpi(values=not (receives and i == len(stagers) - 1))
        specs = [mpi_buffer(s.memory) for s in stagers]
        posting = Posting(stagers, lambda: post(*specs))
        self.data.start(posting)
        return posting, stagers

    def _allreduce(
        self,
        tensors: list[torch.Tensor],
        op: str,
        prescale: float,
        postscale: float,
        out: Sequence[torch.Tensor] | None,
    ) -> tuple[list[Posting], Callable[[], Any]]:
        groups = _wire_groups(tensors)
        flats = _wire_flats(tensors, groups, prescale)
        return self._reduce_flats(flats, op, _MPI_REDUCE[op], postscale, list(groups.values()), tensors, out)

    def _reduce_flats(
        self,
        flats: list[torch.Tensor],
        op: str,
        mpi_op: MPI.Op,
        postscale: float,
        members: list[list[int]],
        tensors: list[torch.Tensor],
        out: Sequence[torch.Tensor] | None,
    ) -> tuple[list[Posting], Callable[[], Any]]:
        size = self.comm.size
        posted = []
        for flat in flats:
            posting, stagers = self._post([flat], lambda spec: self.data.comm.Iallreduce(MPI.IN_PLACE, spec, mpi_op))
            posted.append((posting, stagers[0]))

        def finish() -> Any:
            results: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
            for (_, stager), flat, group in zip(posted, flats, members):
                stager.from_mpi()
                _finish_reduction(flat, op, postscale, size, tensors[group[0]].dtype)
                _pieces(flat, group, tensors, results)
            return _write_out(tensors, results, out)

        return [p for p, _ in posted], finish

    def _inline_allreduce(
        self,
        pending: Pending,
        tensors: list[torch.Tensor],
        op: str,
        postscale: float,
        out: Sequence[torch.Tensor] | None,
    ) -> Callable[[], Any]:
        """An allreduce whose values came in the headers: reduced here, in rank order, alike on every rank."""
        headers = pending.gathered.reshape(self.comm.size, RECORD)
        if headers[:, _JOINED].any():
            headers = headers[[r for r in range(self.comm.size) if not headers[r, _JOINED]]]
        payloads = headers[:, _HEADER + len(pending.meta) :].view(np.uint8)
        results: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
        for wire, members, start, nbytes in pending.layout:
            stacked = payloads[:, start : start + nbytes].view(_NUMPY[wire])
            if op in ("sum", "average"):
                reduced = stacked.sum(axis=0, dtype=stacked.dtype)
            elif op == "product":
                reduced = stacked.prod(axis=0, dtype=stacked.dtype)
            else:
                reduced = stacked.min(axis=0) if op == "min" else stacked.max(axis=0)
            flat = torch.from_numpy(reduced)
            _finish_reduction(flat, op, postscale, self.comm.size, tensors[members[0]].dtype)
            _pieces(flat, members, tensors, results)
        return functools.partial(_write_out, tensors, results, out)

    def _inline_broadcast(
        self, pending: Pending, tensors: list[torch.Tensor], root: int, out: Sequence[torch.Tensor] | None
    ) -> Callable[[], Any]:
        """A broadcast whose values came in the root's header: copied out of that row."""
        base = pending.gathered.ctypes.data + (root * RECORD + _HEADER + len(pending.meta)) * 8
        results = []
        for dtype, members, start, nbytes in pending.layout:
            result = torch.empty(tensors[members[0]].shape, dtype=dtype)
            ctypes.memmove(result.data_ptr(), base + start, nbytes)
            results.append(result)
        return functools.partial(_write_out, tensors, results, out)

    def _allgather(
        self, tensors: list[torch.Tensor], firsts: list[list[int]]
    ) -> tuple[list[Posting], Callable[[], Any]]:
        postings, gathered = [], []
        for i, t in enumerate(tensors):
            src = t.detach().contiguous()
            row = _row_numel(src) * src.element_size()
            counts = [r[i] * row for r in firsts]
            displs = list(itertools.accumulate([0, *counts[:-1]]))
            dst = torch.empty((sum(r[i] for r in firsts), *src.shape[1:]), dtype=src.dtype, device=src.device)
            posting, stagers = self._post(
                [src, dst],
                lambda s, d, c=counts, o=displs: self.data.comm.Iallgatherv(_bytes(s), [_bytes(d)[0], c, o, MPI.BYTE]),
                receives=True,
            )
            postings.append(posting)
            gathered.append((dst, stagers[1]))

        def finish() -> Any:
            for _, stager in gathered:
                stager.from_mpi()
            return [dst for dst, _ in gathered]

        return postings, finish

    def _broadcast(
        self, tensors: list[torch.Tensor], root: int, out: Sequence[torch.Tensor] | None
    ) -> tuple[list[Posting], Callable[[], Any]]:
        if out is None:
            targets = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
        else:
            targets = list(out)
            if self.comm.rank == root:  # the root sends its inputs, wherever its results go
                with torch.no_grad():
                    for target, t in zip(targets, tensors):
                        if target is not t:
                            target.copy_(t)
        bufs = [t if t.is_contiguous() else t.contiguous() for t in targets]
        posted = [self._post([b], lambda s: self.data.comm.Ibcast(_bytes(s), root=root)) for b in bufs]

        def finish() -> Any:
            for (_, stagers), buf, target in zip(posted, bufs, targets):
                stagers[0].from_mpi()
                if buf is not target:
                    target.copy_(buf)
            return targets

        return [p for p, _ in posted], finish

    def _alltoall(self, tensor: torch.Tensor, splits: list[list[int]]) -> tuple[list[Posting], Callable[[], Any]]:
        rank = self.comm.rank
        src = tensor.detach().contiguous()
        row = _row_numel(src) * src.element_size()
        sends = [n * row for n in splits[rank]]
        receives = [r[rank] for r in splits]
        dst = torch.empty((sum(receives), *src.shape[1:]), dtype=src.dtype, device=src.device)
        recv_bytes = [n * row for n in receives]
        sdispl = list(itertools.accumulate([0, *sends[:-1]]))
        rdispl = list(itertools.accumulate([0, *recv_bytes[:-1]]))
        posting, stagers = self._post(
            [src, dst],
            lambda s, d: self.data.comm.Ialltoallv(
                [_bytes(s)[0], sends, sdispl, MPI.BYTE], [_bytes(d)[0], recv_bytes, rdispl, MPI.BYTE]
            ),
            receives=True,
        )

        def finish() -> Any:
            stagers[1].from_mpi()
            return dst, receives

        return [posting], finish

    def _reducescatter(
        self, tensors: list[torch.Tensor], op: str, prescale: float, postscale: float
    ) -> tuple[list[Posting], Callable[[], Any]]:
        size, rank = self.comm.size, self.comm.rank
        posted = []
        for t in tensors:
            wire = _WIRE.get(t.dtype, t.dtype)
            flat = t.detach().contiguous().to(wire, copy=True)
            if prescale != 1.0:
                _scale(flat, prescale, t.dtype)
            rows = scatter_rows(t.shape[0], size)
            per_row = _row_numel(t)
            counts = [n * per_row for n in rows]
            mine = torch.empty((rows[rank], *t.shape[1:]), dtype=wire, device=t.device)
            mpi_type, mpi_op = _MPI_TYPE[wire], _MPI_REDUCE[op]
            posting, stagers = self._post(
                [flat, mine],
                lambda s, d, c=counts, m=mpi_type, o=mpi_op: self.data.comm.Ireduce_scatter([s[0], m], [d[0], m], c, o),
                receives=True,
            )
            posted.append((posting, stagers[1], mine, t))

        def finish() -> Any:
            results = []
            for _, stager, mine, t in posted:
                stager.from_mpi()
                _finish_reduction(mine.view(-1), op, postscale, size, t.dtype)
                results.append(mine if mine.dtype == t.dtype else mine.to(t.dtype))
            return results

        return [p for p, *_ in posted], finish

    # ------------------------------------------------------------- join, barrier
    def complete_started(self, before: str) -> None:
        """Complete this rank's started collectives, in start order, before ``before``.

        Each rank runs them whenever it waits or polls: a call that is not one of them must come
        after them on every rank.
        """
        for started in list(self._pending):
            self.comm.wait_for(started.test, f"{started.kind} before {before}")

    def join(self) -> int:
        """Answer the other ranks' collectives until every rank has joined; the rank that joined last.

        Completes this rank's own started collectives first. While waiting, an allreduce
        of the others gets the reduction's identity from this rank (zeros for a sum).
        """
        self.complete_started("join")
        joined_at = self.rounds
        one = self.one
        request = one.start_joined()  # the others' allreduces of one tensor go by onetensor, not headers

        def answered() -> bool:
            nonlocal request
            if request is not None and request.Test():
                request = one.start_joined() if one.answer_joined() else None
            return self.hdr.test(pending.posting)

        try:
            while True:
                header = np.zeros(RECORD, dtype=np.int64)
                header[_KIND] = KINDS.index("join")
                header[_JOINED] = 1
                header[_JOIN_ROUND] = joined_at
                pending = Pending(self, "join", None, header)
                self.hdr.start(pending.posting)
                self.comm.wait_for(answered, "join")
                self.rounds += 1
                headers = pending.gathered.reshape(self.comm.size, RECORD)
                working = [r for r in range(self.comm.size) if not headers[r, _JOINED]]
                if not working:
                    if request is not None:  # every rank posted it: the last of this join's messages
                        last = request
                        self.comm.wait_for(last.Test, "join's last one-tensor message")
                        one.answer_joined()
                    rounds = headers[:, _JOIN_ROUND].tolist()
                    return max(range(len(rounds)), key=lambda r: (rounds[r], r))
                self._answer(headers, working[0])
        except CommTimeout:
            if request is not None:  # started, perhaps still in flight: onetensor must not start it again
                one.timed_out("join's one-tensor message", request)
            raise

    def _answer(self, headers: np.ndarray[Any, Any], rank: int) -> None:
        """A joined rank's part in the working ranks' call (the same decision they take)."""
        header = headers[rank]
        op = REDUCTIONS[int(header[_OP])]
        if _disagreement(headers) is not None or header[_INLINE]:
            return  # the working ranks raise, or reduce the values the headers carried: no data round
        count = int(header[_META])  # an allreduce's wire groups: at most one per dtype, always in the header
        pairs = header[_HEADER : _HEADER + count].tolist()
        flats = [_identity(op, DTYPES[code], n) for code, n in zip(pairs[::2], pairs[1::2])]
        postings, _ = self._reduce_flats(flats, op, _MPI_REDUCE[op], 1.0, [[]] * len(flats), [], None)
        self.data.wait_posted(postings, "allreduce answered by a joined rank")

    def barrier(self) -> None:
        """Wait until every rank arrives, moving started collectives along meanwhile."""
        posting = Posting((), self.ctl.comm.Ibarrier)
        self.ctl.start(posting)

        def arrived() -> bool:
            self.progress()
            return self.ctl.test(posting)

        self.comm.wait_for(arrived, "barrier")

    def free(self) -> None:
        """Complete what is in flight (collective); the communicator's free releases the splits."""
        self.complete_started("free")
        _OPS.pop(self.comm, None)


_OPS: weakref.WeakKeyDictionary[Communicator, TensorOps] = weakref.WeakKeyDictionary()


def tensor_ops(comm: MPI.Comm | Communicator | None = None) -> TensorOps:
    """The checked collectives of ``comm`` (the world by default), made collectively on first use."""
    wrapper = as_communicator(comm)
    ops = _OPS.get(wrapper)
    if ops is None:
        ops = _OPS[wrapper] = TensorOps(wrapper)
        wrapper.on_free(ops.free)
    return ops


# ---------------------------------------------------------------------- checks
def _check_local(
    kind: str, tensors: list[torch.Tensor], op: str, root: int, splits: Sequence[int] | None, size: int
) -> None:
    """This rank's own arguments (raised at once, before anything is posted)."""
    if kind not in KINDS[:-1]:
        raise ValueError(f"kind must be one of {', '.join(map(repr, KINDS[:-1]))}; got {kind!r}")
    if op not in REDUCTIONS:
        raise ValueError(f"op must be one of {', '.join(map(repr, REDUCTIONS))}; got {op!r}")
    if not tensors:
        raise ValueError(f"{kind} needs at least one tensor")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] is a {type(t).__name__}, not a torch.Tensor")
        if t.dtype not in DTYPES:
            raise TypeError(f"tensors[{i}] has dtype {t.dtype}, which mpisolve's collectives do not move")
        if t.is_sparse:
            raise TypeError(f"tensors[{i}] is sparse: gather its indices and values instead")
    devices = {t.device for t in tensors} if len(tensors) > 1 else ()
    if len(devices) > 1:
        raise ValueError(f"a grouped {kind} needs its tensors on one device, got {sorted(map(str, devices))}")
    if kind in ("allreduce", "reducescatter"):
        if op == "adasum" and kind == "reducescatter":
            raise ValueError("Adasum combines tensors in an allreduce, not a reducescatter")
        if op == "adasum":
            for i, t in enumerate(tensors):
                if not t.is_floating_point():
                    raise TypeError(f"tensors[{i}] has dtype {t.dtype}: Adasum combines floating-point tensors")
        if any(t.dtype == torch.bool for t in tensors) and op not in ("min", "max"):
            raise TypeError(f"bool tensors reduce by min or max only, not {op}")
    if kind in ("allgather", "alltoall", "reducescatter") and any(t.dim() == 0 for t in tensors):
        raise ValueError(f"{kind} splits or joins tensors along their first dimension: a 0-d tensor has none")
    if kind == "broadcast" and not 0 <= root < size:
        raise ValueError(f"a broadcast's root must be a rank of the communicator (0 to {size - 1}), got {root}")
    if kind == "alltoall":
        if len(tensors) != 1:
            raise ValueError("alltoall takes one tensor")
        _check_splits(tensors[0], splits, size)


def _check_splits(tensor: torch.Tensor, splits: Sequence[int] | None, size: int) -> None:
    rows = tensor.shape[0]
    if splits is None:
        if rows % size:
            raise ValueError(f"alltoall without splits needs a first dimension divisible by {size} ranks, got {rows}")
        return
    if len(splits) != size or any(s < 0 for s in splits):
        raise ValueError(f"alltoall splits must be {size} non-negative row counts, got {list(splits)}")
    if sum(splits) != rows:
        raise ValueError(f"alltoall splits sum to {sum(splits)} rows, but the tensor has {rows}")


def _disagreement(headers: np.ndarray[Any, Any]) -> str | None:
    """What is wrong with the ranks' headers, or None: the same answer on every rank.

    The working (not joined) ranks must agree; a joined rank answers an allreduce only.
    """
    checked = headers[:, : _JOINED + 1]
    if not checked[0, _JOINED] and (checked == checked[0]).all():  # the common case: no rank joined, all agree
        return None
    working = [r for r in range(len(headers)) if not headers[r, _JOINED]]
    if not working:
        return None
    ref = headers[working[0]]
    joined = [r for r in range(len(headers)) if headers[r, _JOINED]]
    if joined and (KINDS[int(ref[_KIND])] != "allreduce" or REDUCTIONS[int(ref[_OP])] == "adasum"):
        return f"rank(s) {_ranks(joined)} have joined: only a sum, average, min, max or product allreduce runs then"
    names = {int(headers[r, _NAME]) for r in working} - {0}
    checks = [
        (_KIND, "operations", lambda h: KINDS[int(h[_KIND])]),
        (_OP, "reductions", lambda h: REDUCTIONS[int(h[_OP])]),
        (_ROOT, "roots", lambda h: f"root {int(h[_ROOT])}"),
        (_DEVICE, "devices", lambda h: "cuda" if h[_DEVICE] else "cpu"),
        (_COUNT, "tensor counts", lambda h: f"{int(h[_COUNT])} tensors"),
        (_DTYPE, "dtypes", lambda h: str(DTYPES[int(h[_DTYPE])]).replace("torch.", "")),
        (_SIG, "shapes or dtypes", _shape_text),
        (_META, "sizes", lambda h: f"{int(h[_META])} sizes"),
        (_INLINE, "value bytes", lambda h: f"{int(h[_INLINE])} bytes in the header"),
    ]
    for slot, what, show in checks:
        differ = [r for r in working if headers[r, slot] != ref[slot]]
        if differ:
            return (
                f"the ranks' {what} differ: rank {working[0]} has {show(ref)}, "
                f"rank(s) {_ranks(differ)} have {show(headers[differ[0]])}"
            )
    if len(names) > 1:
        return "the ranks gave the call different names"
    return None


_SIGNATURES: dict[tuple[bool, tuple[tuple[torch.dtype, torch.Size], ...]], int] = {}


def _signature(ragged: bool, tensors: list[torch.Tensor]) -> int:
    """A hash of the tensors' dtypes and shapes (their first dimensions left out if ``ragged``), kept by key."""
    key = (ragged, tuple((t.dtype, t.shape) for t in tensors))
    found = _SIGNATURES.get(key)
    if found is None:
        if len(_SIGNATURES) > 4096:
            _SIGNATURES.clear()
        shapes = [(str(t.dtype), tuple(t.shape)[1:] if ragged else tuple(t.shape)) for t in tensors]
        found = _SIGNATURES[key] = _hash(shapes)
    return found


def _shape_text(header: np.ndarray[Any, Any]) -> str:
    ndim = int(header[_NDIM])
    dims = header[_DIMS : _DIMS + min(ndim, CLEAR_DIMS)].tolist()
    more = ", ..." if ndim > CLEAR_DIMS else ""
    extra = f" (and {int(header[_COUNT]) - 1} more tensors)" if header[_COUNT] > 1 else ""
    return f"{str(DTYPES[int(header[_DTYPE])]).replace('torch.', '')} {dims}{more}{extra}".replace("]...", "...]")


def _label(pending: Pending) -> str:
    return f"{pending.kind} {pending.name!r}" if pending.name else pending.kind


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))


# ------------------------------------------------------------------- arithmetic
def scatter_rows(rows: int, size: int) -> list[int]:
    """How a reduce-scatter splits ``rows``: as evenly as possible, the first ranks one more."""
    return [rows // size + (1 if r < rows % size else 0) for r in range(size)]


def _wire_groups(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[int]]:
    """The tensors' indices by the dtype they are reduced in, in order of first appearance."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(_WIRE.get(t.dtype, t.dtype), []).append(i)
    return groups


def _wire_flats(
    tensors: list[torch.Tensor], groups: dict[torch.dtype, list[int]], prescale: float
) -> list[torch.Tensor]:
    """Each wire group packed into one flat buffer of its wire dtype, prescaled."""
    return [_wire_flat(tensors, members, wire, prescale, None) for wire, members in groups.items()]


def _wire_flat(
    tensors: list[torch.Tensor], members: list[int], wire: torch.dtype, prescale: float, flat: torch.Tensor | None
) -> torch.Tensor:
    """``members`` of ``tensors`` packed end to end into ``flat`` (else a new buffer) of dtype ``wire``, prescaled."""
    flat = _packed([tensors[i].detach() for i in members], wire, tensors[members[0]].device, flat)
    if prescale != 1.0:
        _scale(flat, prescale, tensors[members[0]].dtype)
    return flat


def _inline_layout(
    tensors: list[torch.Tensor], runs: list[tuple[torch.dtype, list[int]]], used: int
) -> list[tuple[torch.dtype, list[int], int, int]]:
    """Where each run of tensors (``dtype``, members) goes in a header's free slots after ``used`` sizes.

    ``(dtype, members, first byte, bytes)`` each, every run 8-byte aligned (viewed there as
    its dtype); empty where they do not fit.
    """
    layout, end = [], 0
    for dtype, members in runs:
        nbytes = sum(tensors[i].numel() for i in members) * dtype.itemsize
        layout.append((dtype, members, end, nbytes))
        end += -(-nbytes // 8) * 8
    return layout if end <= (META - used) * 8 else []


def _inline(
    header: np.ndarray[Any, Any],
    used: int,
    tensors: list[torch.Tensor],
    layout: list[tuple[torch.dtype, list[int], int, int]],
    prescale: float,
) -> None:
    """Write the tensors' (wire-dtype, prescaled) values into the header's free slots, as ``layout`` says.

    Contiguous tensors already of the run's dtype, unscaled, are copied in as bytes (no
    torch call: the small calls' cost); others are cast and scaled by torch.
    """
    base = header.ctypes.data + (_HEADER + used) * 8
    for dtype, members, start, nbytes in layout:
        if prescale == 1.0 and all(tensors[i].dtype == dtype and tensors[i].is_contiguous() for i in members):
            at = base + start
            for i in members:
                ctypes.memmove(at, tensors[i].data_ptr(), tensors[i].nbytes)
                at += tensors[i].nbytes
            continue
        payload = torch.from_numpy(header[_HEADER + used :]).view(torch.uint8)
        _wire_flat(tensors, members, dtype, prescale, payload[start : start + nbytes].view(dtype))


def _pieces(flat: torch.Tensor, members: list[int], tensors: list[torch.Tensor], results: list[torch.Tensor]) -> None:
    """``results[i]`` for i in ``members``: the piece of ``flat`` holding ``tensors[i]``, viewed in its shape."""
    if len(members) == 1:
        results[members[0]] = flat.view(tensors[members[0]].shape)
        return
    for i, piece in zip(members, flat.split([tensors[i].numel() for i in members])):
        results[i] = piece.view(tensors[i].shape)


def _scale(flat: torch.Tensor, factor: float, dtype: torch.dtype) -> None:
    """Scale a wire buffer by ``factor`` as a tensor of ``dtype`` would be.

    Integers in float64 (truncated back), half precision in float32 and rounded to ``dtype``.
    """
    if not dtype.is_floating_point:
        flat.copy_(flat.double().mul_(factor))
    else:
        flat.mul_(factor)
        if dtype != flat.dtype:
            flat.copy_(flat.to(dtype))


def _finish_reduction(flat: torch.Tensor, op: str, postscale: float, size: int, dtype: torch.dtype) -> None:
    """An average's division (integers: truncated) and the postscale, in place on the wire buffer."""
    if op == "average":
        if flat.is_floating_point():
            flat.div_(size)
        else:
            flat.copy_(flat.div(size, rounding_mode="trunc"))
    if postscale != 1.0:
        _scale(flat, postscale, dtype)


def _identity(op: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A buffer that leaves ``op`` unchanged: what a joined rank contributes."""
    if op in ("sum", "average"):
        return torch.zeros(numel, dtype=dtype)
    if op == "product":
        return torch.ones(numel, dtype=dtype)
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    return torch.full((numel,), info.max if op == "min" else info.min, dtype=dtype)


def _row_numel(tensor: torch.Tensor) -> int:
    """Elements in one row (one index of the first dimension), whether or not there are rows."""
    return int(np.prod(tensor.shape[1:], dtype=np.int64))


def _bytes(spec: list[Any]) -> list[Any]:
    """An mpi4py buffer spec as raw bytes."""
    memory = spec[0]
    return [memory.view(np.uint8) if isinstance(memory, np.ndarray) else memory.view(torch.uint8), MPI.BYTE]


def _write_out(
    tensors: list[torch.Tensor], results: list[torch.Tensor], out: Sequence[torch.Tensor] | None
) -> list[torch.Tensor]:
    """The results in the inputs' dtypes: copied into ``out`` (in place) or new tensors."""
    if out is None:
        return [r if r.dtype == t.dtype else r.to(t.dtype) for r, t in zip(results, tensors)]
    with torch.no_grad():
        for target, r in zip(out, results):
            target.copy_(r)
    return list(out)


# ------------------------------------------------------------ the public door
def _one_or_list(tensors: torch.Tensor | Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
    if isinstance(tensors, torch.Tensor):
        return [tensors], True
    return list(tensors), False


def allreduce(
    tensors: torch.Tensor | Sequence[torch.Tensor],
    op: str = "average",
    comm: MPI.Comm | Communicator | None = None,
) -> Any:
    """Reduce a tensor (returns a tensor) or a list of tensors (returns a list) across ranks.

    ``op``: ``"sum"``, ``"average"`` (integers: truncated), ``"min"``, ``"max"``,
    ``"product"``, or ``"adasum"`` (floats). Floating-point sums, averages and Adasum of a
    list take the fused, node-aware path of :func:`.collectives.allreduce`; other dtypes and
    reductions are checked across ranks first (:class:`TensorMismatchError` on every
    rank when shapes or dtypes differ), and so is one tensor, whatever its dtype, reduction
    or device (:mod:`.onetensor`): a sum or average of one float CPU tensor is then one
    message a call (a node-shared round, or one MPI call), any other goes on after the check.
    Calls started on the communicator and not yet complete (:mod:`mpisolve.horovod`'s) are
    completed first: each rank runs them when it waits or polls, and this call must come after
    them on every rank.
    The inputs are untouched.
    """
    wrapper = as_communicator(comm)
    if isinstance(tensors, torch.Tensor) and op in REDUCTIONS and tensors.layout is torch.strided:
        one = one_tensor(wrapper)
        if one.ops is not None:
            one.ops.complete_started("mpisolve.allreduce")
        reduced = one.allreduce(tensors, op)  # checked across ranks, whatever its path
        if reduced is not None:
            return reduced
    elif (started := _OPS.get(wrapper)) is not None:
        started.complete_started("mpisolve.allreduce")
    given, single = _one_or_list(tensors)
    if op not in REDUCTIONS:
        raise ValueError(f"op must be one of {', '.join(map(repr, REDUCTIONS))}; got {op!r}")
    floats = all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in given)
    if floats and op in ("sum", "average", "adasum"):
        out = float_allreduce(given, op=op, comm=wrapper)
    else:
        out = tensor_ops(wrapper).start("allreduce", given, op=op).wait()
    return out[0] if single else out


def allgather(tensors: torch.Tensor | Sequence[torch.Tensor], comm: MPI.Comm | Communicator | None = None) -> Any:
    """Every rank's tensor concatenated along the first dimension, in rank order.

    First dimensions may differ between ranks; the others, and dtypes, may not.
    """
    given, single = _one_or_list(tensors)
    out = tensor_ops(comm).start("allgather", given).wait()
    return out[0] if single else out


def broadcast(
    tensors: torch.Tensor | Sequence[torch.Tensor], root: int = 0, comm: MPI.Comm | Communicator | None = None
) -> Any:
    """``root``'s tensor(s), as new tensors on every rank (the inputs are untouched)."""
    given, single = _one_or_list(tensors)
    out = tensor_ops(comm).start("broadcast", given, root=root).wait()
    return out[0] if single else out


def alltoall(
    tensor: torch.Tensor, splits: Sequence[int] | None = None, comm: MPI.Comm | Communicator | None = None
) -> tuple[torch.Tensor, list[int]]:
    """Send ``splits[r]`` consecutive rows of ``tensor`` to rank r (default: equal shares).

    Returns the rows received, in rank order, and how many came from each rank.
    """
    result: tuple[torch.Tensor, list[int]] = tensor_ops(comm).start("alltoall", [tensor], splits=splits).wait()
    return result


def reducescatter(
    tensors: torch.Tensor | Sequence[torch.Tensor], op: str = "average", comm: MPI.Comm | Communicator | None = None
) -> Any:
    """Reduce across ranks and keep this rank's rows.

    The first dimension is split as evenly as possible, the first ranks one row more
    (:func:`scatter_rows`).
    """
    given, single = _one_or_list(tensors)
    out = tensor_ops(comm).start("reducescatter", given, op=op).wait()
    return out[0] if single else out


def process_set(ranks: Sequence[int], comm: MPI.Comm | Communicator | None = None) -> Communicator | None:
    """A communicator of ``ranks`` of ``comm`` (in that order's rank order); None on the other ranks.

    Collective over ``comm``: every rank calls it with the same ranks. Free it with its
    ``free()`` (collective over its ranks).
    """
    parent = as_communicator(comm)
    members = sorted(set(int(r) for r in ranks))
    if len(members) != len(list(ranks)) or not members or members[0] < 0 or members[-1] >= parent.size:
        raise ValueError(f"a process set needs distinct ranks of 0 to {parent.size - 1}, got {list(ranks)}")
    return parent.split(0 if parent.rank in members else None)


def threads_supported() -> bool:
    """Whether MPI was started with ``MPI_THREAD_MULTIPLE`` (any thread may call it at any time)."""
    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)
