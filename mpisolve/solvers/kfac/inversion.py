"""Inverting (or eigendecomposing) the factors where the placement says, and sharing the results.

Each rank inverts the factors it owns and those every rank inverts, stacked by size into
one batched kernel call per size (``mpisolve.kernels.inverse``). Owned results go out in
persistent broadcasts: one per factor, or one per owner with the owner's results fused
(``fuse_broadcasts``), each inverse as its upper triangle where ``packed`` says so (the
inverse method's results are symmetric; eigenvectors are not). Broadcasts are started
in one order on every rank (by root): a rank posts the receives from lower roots before
it computes, its own broadcast as soon as its owned results are ready, and computes the
replicated factors while everything moves.

Whether a result is usable (kernel status) travels in one small MAX-allreduce, so every
rank makes the same choice: a FAILED factor keeps its previous decomposition (the
identity before the first one) everywhere, and a warning names it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ...comm.buckets import FusedBuffer
from ...comm.communicator import Communicator, PersistentBcast
from ...kernels.inverse import FAILED, eigh_psd_, inverse_spd_
from ...kernels.triangle import pack_triu, triangle_numel, unpack_triu_
from .layers import Factor
from .placement import EVERY_RANK


def result_shapes(n: int, method: str, packed: bool) -> list[torch.Size]:
    """How one n x n factor's decomposition travels: the inverse (its upper triangle when
    ``packed``), or eigenvectors and eigenvalues (eigenvectors are not symmetric)."""
    if method == "eigen":
        return [torch.Size([n, n]), torch.Size([n])]
    return [torch.Size([triangle_numel(n)])] if packed else [torch.Size([n, n])]


class _Batch:
    """Factors of one size that this rank inverts in one kernel call."""

    def __init__(self, members: list[int], n: int, method: str, dtype: torch.dtype, device: torch.device) -> None:
        self.members = members
        self.stack = torch.empty(len(members), n, n, dtype=dtype, device=device)
        self.values = torch.empty(len(members), n, dtype=dtype, device=device) if method == "eigen" else None


def _batches(members: list[int], factors: Sequence[Factor], method: str) -> list[_Batch]:
    by_size: dict[int, list[int]] = {}
    for f in members:
        by_size.setdefault(factors[f].dim, []).append(f)
    first = factors[members[0]] if members else None
    if first is None:
        return []
    dtype, device = first.running.dtype, first.running.device
    # Largest first: the owner's broadcast waits for all of its batches anyway, and the
    # small ones finish while the large ones' predecessors are on the wire.
    return [_Batch(fs, n, method, dtype, device) for n, fs in sorted(by_size.items(), reverse=True)]


class Inverter:
    """Runs one inversion round for ``factors`` placed by ``owners`` (``EVERY_RANK`` = all)."""

    def __init__(
        self,
        comm: Communicator,
        factors: Sequence[Factor],
        owners: Sequence[int],
        *,
        method: str,
        packed: Sequence[bool],
        fuse_broadcasts: bool,
    ) -> None:
        if len(owners) != len(factors) or len(packed) != len(factors):
            raise ValueError("one owner and one packing choice per factor")
        self.comm = comm
        self.factors = list(factors)
        self.owners = list(owners)
        self.method = method
        self.packed = [p and method == "inverse" for p in packed]  # eigenvectors are not symmetric
        rank = comm.rank
        owned = [f for f, o in enumerate(owners) if o == rank]
        replicated = [f for f, o in enumerate(owners) if o == EVERY_RANK]
        self._owned_batches = _batches(owned, self.factors, method)
        self._replicated_batches = _batches(replicated, self.factors, method)
        self._where: dict[int, tuple[_Batch, int]] = {}
        for batch in self._owned_batches + self._replicated_batches:
            for i, f in enumerate(batch.members):
                self._where[f] = (batch, i)
        device = self.factors[0].running.device if self.factors else torch.device("cpu")
        # Broadcast groups, in the order every rank starts them: by root, then factor.
        placed = sorted((o, f) for f, o in enumerate(owners) if o != EVERY_RANK)
        groups: list[tuple[int, list[int]]] = []
        for root, f in placed:
            if fuse_broadcasts and groups and groups[-1][0] == root:
                groups[-1][1].append(f)
            else:
                groups.append((root, [f]))
        self.broadcast_groups = groups
        self._payload: dict[int, list[torch.Tensor]] = {}
        self._buffers: list[FusedBuffer] = []
        self._requests: list[PersistentBcast] = []
        for root, members in groups:
            shapes = [s for f in members for s in self._wire_shapes(f)]
            buffer = FusedBuffer(shapes, self.factors[members[0]].running.dtype, device)
            self._buffers.append(buffer)
            i = 0
            for f in members:
                count = len(self._wire_shapes(f))
                self._payload[f] = buffer.views[i : i + count]
                i += count
            self._requests.append(comm.persistent_bcast(buffer.flat, root))
        self._status = torch.zeros(len(self.factors), dtype=torch.int32)
        self._status_request = comm.persistent_allreduce(self._status, "max")
        #: Seconds of the last round: inverting (kernels, packing) and waiting on communication.
        self.seconds = {"inversion": 0.0, "inverse_comm": 0.0}

    def _wire_shapes(self, f: int) -> list[torch.Size]:
        return result_shapes(self.factors[f].dim, self.method, self.packed[f])

    # --------------------------------------------------------------- a round
    def run(self, shifts: Sequence[float]) -> list[int]:
        """Decompose every factor (damped by ``shifts`` for the inverse method); the statuses."""
        compute = comm_wait = 0.0
        self._status.zero_()
        rank = self.comm.rank
        first_own = next(
            (i for i, (root, _) in enumerate(self.broadcast_groups) if root >= rank), len(self.broadcast_groups)
        )
        for request in self._requests[:first_own]:
            request.start()  # receives from lower roots: nothing to wait for
        start = time.perf_counter()
        for batch in self._owned_batches:
            self._decompose(batch, shifts)
            for i, f in enumerate(batch.members):
                self._to_wire(f, batch, i)
            self._progress()
        compute += time.perf_counter() - start
        for request in self._requests[first_own:]:
            request.start()
        start = time.perf_counter()
        for batch in self._replicated_batches:
            self._decompose(batch, shifts)
            self._progress()
        compute += time.perf_counter() - start
        start = time.perf_counter()
        self._status_request.start()
        for i, request in enumerate(self._requests):
            request.wait(f"K-FAC inverse broadcast {i} from rank {self.broadcast_groups[i][0]}")
        self._status_request.wait("K-FAC inversion status")
        comm_wait += time.perf_counter() - start
        start = time.perf_counter()
        statuses = self._status.tolist()
        for f, factor in enumerate(self.factors):
            if statuses[f] == FAILED and factor.inverted:
                continue  # keep the previous decomposition
            self._commit(f, factor)
            factor.inverted = True
        compute += time.perf_counter() - start
        self.seconds = {"inversion": compute, "inverse_comm": comm_wait}
        return statuses

    def _progress(self) -> None:
        for request in self._requests:
            request.test()

    def _decompose(self, batch: _Batch, shifts: Sequence[float]) -> None:
        for i, f in enumerate(batch.members):
            self.factors[f].fill(batch.stack[i])
        if self.method == "inverse":
            status = inverse_spd_(batch.stack, [shifts[f] for f in batch.members])
        else:
            status = eigh_psd_(batch.stack, batch.values)
        for i, f in enumerate(batch.members):
            self._status[f] = int(status[i])

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

    def _commit(self, f: int, factor: Factor) -> None:
        if self.owners[f] == EVERY_RANK:
            batch, i = self._where[f]
            sources = [batch.stack[i]] if batch.values is None else [batch.stack[i], batch.values[i]]
            for target, source in zip(factor.decomposition(), sources):
                target.copy_(source)
        elif self.packed[f]:
            unpack_triu_(self._payload[f][0], factor.inverse)
        else:
            for target, source in zip(factor.decomposition(), self._payload[f]):
                target.copy_(source)

    def close(self) -> None:
        for request in self._requests:
            request.free()
        self._requests.clear()
        self._status_request.free()
