"""Inverting (or eigendecomposing) one group's factors where the placement says, and sharing the results.

A rank works on the factors of its own group's layers (see :mod:`.placement`). It inverts
those it owns and those every member inverts, stacked by size into one batched kernel
call per size (``mpisolve.kernels.inverse``). Owned results go to the group's other
members in persistent broadcasts on one communicator per root (so no root's broadcast
waits for another root to reach it): one broadcast per batch of equal-sized factors
(``fuse_broadcasts``) or per factor, each inverse as its upper triangle where ``packed``
says so (the inverse method's results are symmetric; eigenvectors are not). Every rank
posts its receives before it computes, and a root starts each broadcast as soon as its
batch is done.

A round does not wait for the broadcasts: :meth:`Inverter.start` inverts and starts
them; the solver asks :meth:`Inverter.ready` per factor, preconditions the layers whose
decompositions are here while the others travel, and :meth:`Inverter.wait` only for a
factor it needs next. Each broadcast carries its factors' kernel statuses (a FAILED one
keeps its previous decomposition, the identity before the first, on every member alike)
and the time its root started it, on a clock the ranks share (``epoch``): a receiver's
blocked time splits into ``inverse_wait`` (before the root had its result: waiting for
another rank's inversion) and ``inverse_transfer`` (after: moving the bytes).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ...comm.communicator import Communicator
from ...comm.engine import Reusable
from ...comm.flat import FusedBuffer
from ...comm.reusable import reusable_bcast
from ...kernels.inverse import FAILED, eigh_psd_, inverse_spd_
from ...kernels.triangle import pack_triu, triangle_numel, unpack_triu_
from .layers import Factor
from .placement import EVERY_RANK

#: Trailing elements of a broadcast that carry its root's start time (two floats: high and low part).
STAMP_SLOTS = 2


def result_shapes(n: int, method: str, packed: bool) -> list[torch.Size]:
    """How one n x n factor's decomposition travels: the inverse (its upper triangle when
    ``packed``), or eigenvectors and eigenvalues (eigenvectors are not symmetric)."""
    if method == "eigen":
        return [torch.Size([n, n]), torch.Size([n])]
    return [torch.Size([triangle_numel(n)])] if packed else [torch.Size([n, n])]


def write_stamp(slots: torch.Tensor, seconds: float) -> None:
    """Store ``seconds`` in two slots of a float32 (or wider) buffer without losing precision."""
    high = float(torch.tensor(seconds, dtype=slots.dtype))
    slots[0].fill_(high)  # fill_: a device tensor's t[i] = x copies from the host, which waits
    slots[1].fill_(seconds - high)


def read_stamp(slots: torch.Tensor) -> float:
    """The seconds :func:`write_stamp` stored in host ``slots`` (read through their memory: a device's would wait)."""
    high, low = slots[:2].numpy()
    return float(high) + float(low)


def split_blocked(start: float, end: float, sent: float) -> tuple[float, float]:
    """A blocked interval ``[start, end]`` on a message its sender started at ``sent``:
    (seconds waiting for the sender, seconds of transfer)."""
    waiting = min(max(sent - start, 0.0), end - start)
    return waiting, end - start - waiting


class _Batch:
    """Factors of one size that this rank inverts in one kernel call."""

    def __init__(self, members: list[int], n: int, method: str, dtype: torch.dtype, device: torch.device) -> None:
        self.members = members
        self.stack = torch.empty(len(members), n, n, dtype=dtype, device=device)
        self.values = torch.empty(len(members), n, dtype=dtype, device=device) if method == "eigen" else None


def by_size(members: Sequence[int], factors: Sequence[Factor]) -> list[list[int]]:
    """``members`` grouped by factor size, largest first: a root's broadcast order is known to all."""
    sizes: dict[int, list[int]] = {}
    for f in members:
        sizes.setdefault(factors[f].dim, []).append(f)
    return [fs for _, fs in sorted(sizes.items(), reverse=True)]


class _Message:
    """One broadcast: ``members``' decompositions, their statuses, the root's start time."""

    def __init__(self, root: int, members: list[int], buffer: FusedBuffer, request: Reusable) -> None:
        self.root = root
        self.members = members
        self.buffer = buffer
        self.request = request
        self.statuses = buffer.extra[: len(members)]
        self.stamp = buffer.extra[len(members) :]


class Inverter:
    """Inversion rounds of one group's factors.

    ``members``: indices (into ``factors``) of the factors this rank's group handles;
    ``owners[f]``: the rank of ``comm`` (the group's communicator) that inverts factor f,
    or ``EVERY_RANK`` (every member). ``epoch``: this rank's ``perf_counter`` at an
    instant all ranks share (after a barrier).
    """

    def __init__(
        self,
        comm: Communicator,
        factors: Sequence[Factor],
        members: Sequence[int],
        owners: Sequence[int],
        *,
        method: str,
        packed: Sequence[bool],
        fuse_broadcasts: bool,
        epoch: float,
    ) -> None:
        if len(owners) != len(factors) or len(packed) != len(factors):
            raise ValueError("one owner and one packing choice per factor")
        self.comm = comm
        self.factors = list(factors)
        self.members = list(members)
        self.owners = list(owners)
        self.method = method
        self.packed = [p and method == "inverse" for p in packed]  # eigenvectors are not symmetric
        self.epoch = epoch
        rank = comm.rank
        dtype = self.factors[0].running.dtype if self.factors else torch.float32
        device = self.factors[0].running.device if self.factors else torch.device("cpu")
        owned = [f for f in self.members if self.owners[f] == rank]
        replicated = [f for f in self.members if self.owners[f] == EVERY_RANK]
        self._owned_batches = [self._batch(fs, dtype, device) for fs in by_size(owned, self.factors)]
        self._replicated_batches = [self._batch(fs, dtype, device) for fs in by_size(replicated, self.factors)]
        self._where: dict[int, tuple[_Batch, int]] = {}
        for batch in self._owned_batches + self._replicated_batches:
            for i, f in enumerate(batch.members):
                self._where[f] = (batch, i)
        # Messages: per root (in rank order, each on a communicator of its own), its
        # batches largest first, one message per batch or per factor.
        self.messages: list[_Message] = []
        self._root_comms: list[Communicator] = []
        roots = sorted({self.owners[f] for f in self.members} - {EVERY_RANK})
        for root in roots if comm.size > 1 else []:
            root_comm = comm.dup()
            self._root_comms.append(root_comm)
            for equal in by_size([f for f in self.members if self.owners[f] == root], self.factors):
                for group in [equal] if fuse_broadcasts else [[f] for f in equal]:
                    shapes = [s for f in group for s in self._wire_shapes(f)]
                    buffer = FusedBuffer(shapes, dtype, device, extra=len(group) + STAMP_SLOTS)
                    self.messages.append(_Message(root, group, buffer, reusable_bcast(root_comm, buffer.flat, root)))
        self._message_of: dict[int, _Message] = {}
        self._payload: dict[int, list[torch.Tensor]] = {}
        for message in self.messages:
            i = 0
            for f in message.members:
                count = len(self._wire_shapes(f))
                self._payload[f] = message.buffer.views[i : i + count]
                self._message_of[f] = message
                i += count
        #: The messages each owned batch fills, in their start order.
        self._outgoing = {
            id(batch): [m for m in self.messages if m.root == rank and m.members[0] in batch.members]
            for batch in self._owned_batches
        }
        self._pending: list[_Message] = []
        self._sending: list[_Message] = []
        #: The kernel status of each factor of the last round (0 for other groups' factors).
        self.statuses = torch.zeros(len(self.factors), dtype=torch.int32)
        #: Seconds of the last round: inverting (kernels, packing, unpacking), waiting for
        #: roots' results, and transfers.
        self.seconds = {"inversion": 0.0, "inverse_wait": 0.0, "inverse_transfer": 0.0}

    def _batch(self, members: list[int], dtype: torch.dtype, device: torch.device) -> _Batch:
        return _Batch(members, self.factors[members[0]].dim, self.method, dtype, device)

    def _wire_shapes(self, f: int) -> list[torch.Size]:
        return result_shapes(self.factors[f].dim, self.method, self.packed[f])

    # --------------------------------------------------------------- a round
    def start(self, shifts: Sequence[float]) -> None:
        """Decompose this rank's factors (damped by ``shifts`` for the inverse method), start
        its broadcasts and post its receives; commit what is here."""
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.statuses.zero_()
        rank = self.comm.rank
        start = time.perf_counter()
        self._pending = [m for m in self.messages if m.root != rank]
        for message in self._pending:
            message.request.start()  # receives first: nothing to wait for
        self._sending = []
        for batch in self._owned_batches:
            self._decompose(batch, shifts)
            for message in self._outgoing[id(batch)]:
                self._send(message)
            for f in batch.members:
                if f not in self._message_of:  # a group of one: nobody to send to
                    self._commit(f, int(self.statuses[f]))
            self.progress()
        for batch in self._replicated_batches:
            self._decompose(batch, shifts)
            for f in batch.members:
                self._commit(f, int(self.statuses[f]))
            self.progress()
        self.seconds["inversion"] += time.perf_counter() - start

    def _send(self, message: _Message) -> None:
        for i, f in enumerate(message.members):
            batch, j = self._where[f]
            self._to_wire(f, batch, j)
            message.statuses[i].fill_(float(self.statuses[f]))
            self._commit(f, int(self.statuses[f]))
        write_stamp(message.stamp, time.perf_counter() - self.epoch)
        message.request.start()
        self._sending.append(message)

    @property
    def in_flight(self) -> bool:
        """Whether a round's broadcasts were started and not all completed."""
        return bool(self._pending or self._sending)

    def ready(self, f: int) -> bool:
        """Whether factor ``f``'s decomposition of this round is here and committed."""
        message = self._message_of.get(f)
        return message is None or message not in self._pending

    def progress(self) -> None:
        """Let MPI move the broadcasts along; commit those that arrived."""
        for message in list(self._pending):
            if message.request.test():
                # Complete it (at once): a staged broadcast's result reaches the buffer only here.
                message.request.wait(f"K-FAC inverse broadcast from rank {message.root}")
                self._arrived(message)
        self._sending = [m for m in self._sending if not m.request.test()]

    def wait(self, f: int) -> None:
        """Block until factor ``f``'s broadcast arrived (timed: waiting vs transfer), and commit it."""
        message = self._message_of.get(f)
        if message is None or message not in self._pending:
            return
        start = time.perf_counter()
        message.request.wait(f"K-FAC inverse broadcast of {self.factors[f].name} from rank {message.root}")
        end = time.perf_counter()
        # A stamp on a device would cost a wait to read: there the whole interval counts as transfer.
        sent = self.epoch + read_stamp(message.stamp) if message.stamp.device.type == "cpu" else start
        waiting, transfer = split_blocked(start, end, sent)
        self.seconds["inverse_wait"] += waiting
        self.seconds["inverse_transfer"] += transfer
        self._arrived(message)

    def finish(self) -> None:
        """Complete the round: every receive committed, every own broadcast sent."""
        for message in list(self._pending):
            self.wait(message.members[0])
        start = time.perf_counter()
        for message in self._sending:
            message.request.wait(f"K-FAC inverse broadcast from rank {message.root}")
        self._sending = []
        self.seconds["inverse_transfer"] += time.perf_counter() - start

    def _arrived(self, message: _Message) -> None:
        start = time.perf_counter()
        self._pending.remove(message)
        for i, f in enumerate(message.members):
            status = int(round(float(message.statuses[i])))
            self.statuses[f] = status
            self._commit(f, status)
        self.seconds["inversion"] += time.perf_counter() - start

    def _decompose(self, batch: _Batch, shifts: Sequence[float]) -> None:
        for i, f in enumerate(batch.members):
            self.factors[f].fill(batch.stack[i])
        if self.method == "inverse":
            status = inverse_spd_(batch.stack, [shifts[f] for f in batch.members])
        else:
            status = eigh_psd_(batch.stack, batch.values)
        for i, f in enumerate(batch.members):
            self.statuses[f] = int(status[i])

    def _to_wire(self, f: int, batch: _Batch, i: int) -> None:
        payload = self._payload[f]
        if self.method == "eigen":
            assert batch.values is not None  # built for the eigen method
            payload[0].copy_(batch.stack[i])
            payload[1].copy_(batch.values[i])
        elif self.packed[f]:
            pack_triu(batch.stack[i], payload[0])
        else:
            payload[0].copy_(batch.stack[i])

    def _commit(self, f: int, status: int) -> None:
        """Factor f's new decomposition into place, unless it FAILED and an older one exists.

        Broadcast factors are committed from the wire on every member, root included, so
        all members hold the same numbers."""
        factor = self.factors[f]
        if status == FAILED and factor.inverted:
            return
        if f not in self._message_of:
            batch, i = self._where[f]
            sources = [batch.stack[i]] if batch.values is None else [batch.stack[i], batch.values[i]]
            for target, source in zip(factor.decomposition(), sources):
                target.copy_(source)
        elif self.packed[f]:
            unpack_triu_(self._payload[f][0], factor.inverse)
        else:
            for target, source in zip(factor.decomposition(), self._payload[f]):
                target.copy_(source)
        factor.inverted = True

    def close(self) -> None:
        for message in self.messages:
            message.request.free()
        self.messages.clear()
