"""One step's batch factors, summed over ranks in fused messages.

Each factor's batch value is computed (by the layer hooks) into :meth:`FactorExchange.target`
and handed over with :meth:`FactorExchange.ready`. Factors travel in groups, each group
one flat buffer with one persistent allreduce; a group may be started as soon as all of
its factors are ready (SPD-KFAC's pipelining) or only in :meth:`FactorExchange.finish`
(D-KFAC and MPD-KFAC). Groups start in a fixed order on every rank, so collectives match.

Every factor has a count (1 from each rank that computed it this step), summed with the
factors: a layer that did not run on some rank (or anywhere) is averaged over the ranks
that did (or left alone), instead of being pulled towards zero. The counts are host
values (:class:`~mpisolve.comm.flat.HostTally`): at the end of each group's message
on the CPU, in a host buffer of their own beside device messages.

Gradient accumulation: the micro-batches before a step's last are added into their
factors' slots (:meth:`FactorExchange.accumulate`, each weighted by the caller), and the
last one's :meth:`FactorExchange.ready` scales the sum and sends it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...comm.communicator import Communicator
from ...comm.engine import Reusable
from ...comm.flat import FusedBuffer, HostTally, Tally
from ...comm.reusable import reusable_sum
from ...kernels.triangle import pack_triu, triangle_numel


class FactorExchange:
    """Batch factors ``0..F-1`` of sizes ``dims``, summed over ranks in ``groups``.

    ``groups``: factor indices, each group one message, started in list order.
    ``packed``: symmetric factors travel as upper triangles. ``eager``: a group starts
    when its last factor is ready (and every earlier group has started).
    """

    def __init__(
        self,
        comm: Communicator,
        dims: Sequence[int],
        names: Sequence[str],
        groups: Sequence[Sequence[int]],
        *,
        packed: bool,
        eager: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        members = sorted(f for g in groups for f in g)
        if members != list(range(len(dims))):
            raise ValueError("fusion groups must hold every factor exactly once")
        self.comm = comm
        self.dims = list(dims)
        self.names = list(names)
        self.groups = [list(g) for g in groups]
        self.packed = packed
        self.eager = eager
        # Packed factors are computed (their upper triangles) into a scratch matrix per size, then packed;
        # a micro-batch's factor after the first of an accumulated step too (made when first needed).
        self._dtype, self._device = dtype, device
        self._scratch = {n: torch.empty(n, n, dtype=dtype, device=device) for n in set(self.dims)} if packed else {}
        self._packed_scratch: dict[int, torch.Tensor] = {}  # packed: an accumulated micro-batch's triangle
        self.buffers: list[FusedBuffer] = []
        self._slot: list[torch.Tensor] = [torch.empty(0)] * len(dims)
        self._group_of = [0] * len(dims)
        self._tallies: list[HostTally] = []
        for g, group in enumerate(self.groups):
            shapes = [
                torch.Size([triangle_numel(self.dims[f])]) if packed else torch.Size([self.dims[f]] * 2) for f in group
            ]
            buffer = FusedBuffer(shapes, dtype, device, extra=len(group))
            self.buffers.append(buffer)
            for i, f in enumerate(group):
                self._slot[f] = buffer.views[i]
                self._group_of[f] = g
        self.requests: list[Reusable] = [reusable_sum(comm, b.flat) for b in self.buffers]
        count_of: dict[int, tuple[HostTally, int]] = {}
        for group, buffer in zip(self.groups, self.buffers):
            tally = HostTally(comm, Tally(counts=len(group)), buffer.flat)
            self._tallies.append(tally)
            count_of.update((f, (tally, i)) for i, f in enumerate(group))
        #: Each factor's count: (its group's tally, its place there).
        self._count = [count_of[f] for f in range(len(dims))]
        self.captured = [False] * len(dims)
        #: Factors whose slot holds a weighted sum of this step's micro-batches so far (not yet ready).
        self.partial = [False] * len(dims)
        self._pending = [len(g) for g in self.groups]
        self._next = 0
        self._finished = False
        self._inflight: list[Reusable] = []

    @property
    def in_flight(self) -> bool:
        """Whether a message of this step has started and :meth:`finish` has not completed them."""
        return self._next > 0 and not self._finished

    @property
    def finished(self) -> bool:
        """Whether :meth:`finish` has completed this step's messages."""
        return self._finished

    def wire_numel(self, f: int) -> int:
        """Elements factor ``f`` puts on the wire."""
        return self._slot[f].numel()

    # ---------------------------------------------------------------- hooks
    def target(self, f: int) -> torch.Tensor:
        """Where factor ``f``'s batch value is to be computed (an n x n tensor)."""
        if self.packed or self.partial[f]:
            n = self.dims[f]
            if n not in self._scratch:
                self._scratch[n] = torch.empty(n, n, dtype=self._dtype, device=self._device)
            return self._scratch[n]
        return self._slot[f]

    def accumulate(self, f: int, weight: float) -> None:
        """A micro-batch's factor ``f`` is in :meth:`target`: add it, times ``weight``, to the step's sum
        (not sent: a later micro-batch's :meth:`ready` sends it)."""
        self._check_once(f)
        slot = self._slot[f]
        if not self.partial[f]:
            if self.packed:
                pack_triu(self._scratch[self.dims[f]], slot)
            slot.mul_(weight)
            self.partial[f] = True
            return
        value = self._scratch[self.dims[f]]
        if self.packed:
            n = self.dims[f]
            if n not in self._packed_scratch:
                self._packed_scratch[n] = torch.empty_like(slot)
            value = pack_triu(value, self._packed_scratch[n])
        slot.add_(value, alpha=weight)

    def ready(self, f: int, scale: float = 1.0) -> None:
        """Factor ``f`` is in :meth:`target` (its micro-batches' sum is in the slot, after
        :meth:`accumulate`: times ``scale`` it is the factor): put it in its message; maybe start messages."""
        self._check_once(f)
        if self.partial[f]:
            self._slot[f].mul_(scale)
            self.partial[f] = False
        elif self.packed:
            pack_triu(self._scratch[self.dims[f]], self._slot[f])
        tally, i = self._count[f]
        tally.host[i] = 1
        self.captured[f] = True
        g = self._group_of[f]
        self._pending[g] -= 1
        if self.eager and self._pending[g] == 0:
            while self._next < len(self.groups) and self._pending[self._next] == 0:
                self._start(self._next)
        self.progress()

    def _check_once(self, f: int) -> None:
        if self.captured[f]:
            raise RuntimeError(
                f"mpisolve kfac: factor {self.names[f]} was computed twice in one step: the layer ran "
                "forward or backward twice between two step() calls outside no_sync() (for gradient "
                "accumulation, run every backward but the last inside `with solver.no_sync():`; weight "
                "sharing and activation recomputation are not supported)"
            )

    def progress(self) -> None:
        """Let MPI move the messages in flight along."""
        if self._inflight:
            self._inflight = [r for r in self._inflight if not r.test()]

    def _start(self, g: int) -> None:
        for f in self.groups[g]:
            if not self.captured[f]:  # did not run here: contributes nothing
                self._slot[f].zero_()
                tally, i = self._count[f]
                tally.host[i] = 0
        self.requests[g].start()
        self._tallies[g].start()
        self._inflight.append(self.requests[g])
        self._next = g + 1

    # ----------------------------------------------------------------- step
    def finish(self) -> None:
        """Start what has not started, in order, and complete every message."""
        while self._next < len(self.groups):
            self._start(self._next)
        for g, request in enumerate(self.requests):
            request.wait(f"K-FAC factor allreduce {g}")
            self._tallies[g].wait(f"K-FAC factor counts {g}")
        self._inflight.clear()
        self._finished = True

    def result(self, f: int) -> tuple[torch.Tensor, int]:
        """After :meth:`finish`: the sum of factor ``f`` over ranks (upper triangle when packed)
        and how many ranks computed it."""
        tally, i = self._count[f]
        return self._slot[f], int(round(tally.host[i]))

    def rearm(self) -> None:
        """Expect the next step's factors."""
        self.captured = [False] * len(self.dims)
        self.partial = [False] * len(self.dims)
        self._pending = [len(g) for g in self.groups]
        self._next = 0
        self._finished = False

    def close(self) -> None:
        """Free the messages' requests (a step in flight must be finished first, on every rank)."""
        for request in self.requests:
            request.free()
        self.requests.clear()
        for tally in self._tallies:
            tally.free()
        self._tallies.clear()
