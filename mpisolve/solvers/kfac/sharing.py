"""Preconditioned gradients from each layer's gradient worker to the rest of its row.

With fewer gradient workers than ranks (see :mod:`.placement`), the ranks of one row
(``comm``) split the layers: row rank j preconditions the layers of group j and
broadcasts each result to the others. Each root's layers travel on a communicator of its
own, in layer order, so no root's broadcast waits for another root to reach it; every
rank posts its receives before it preconditions anything. Each message is the layer's
result matrix (the layer computes straight into it) plus a flag (1: preconditioned; 0:
the layer was not ready, keep the plain gradient) and the root's start time, so a
receiver's blocked time splits into waiting for the root and transfer, as for inverses.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ...comm.communicator import Communicator
from ...comm.engine import Reusable
from ...comm.flat import FusedBuffer
from ...comm.reusable import reusable_bcast
from .inversion import STAMP_SLOTS, read_stamp, split_blocked, write_stamp


class GradientSharing:
    """Broadcasts of layer results within a row: ``roots[l]`` (a rank of ``comm``) computes layer l."""

    def __init__(
        self,
        comm: Communicator,
        shapes: Sequence[torch.Size],
        roots: Sequence[int],
        *,
        dtype: torch.dtype,
        device: torch.device,
        epoch: float,
    ) -> None:
        self.comm = comm
        self.roots = list(roots)
        self.epoch = epoch
        #: Per layer: the result matrix, then the flag and the stamp.
        self.buffers = [FusedBuffer([shape], dtype, device, extra=1 + STAMP_SLOTS) for shape in shapes]
        self.results = [b.views[0] for b in self.buffers]
        #: Per layer, on the device: 1 where its root preconditioned it, 0 where the plain gradient stays.
        self.flags = [b.extra[0] for b in self.buffers]
        self._requests: list[Reusable | None] = [None] * len(shapes)
        self._root_comms: list[Communicator] = []
        if comm.size > 1:
            for root in sorted(set(self.roots)):
                root_comm = comm.dup()
                self._root_comms.append(root_comm)
                for layer, r in enumerate(self.roots):
                    if r == root:
                        self._requests[layer] = reusable_bcast(root_comm, self.buffers[layer].flat, root)
        self.mine = [layer for layer, r in enumerate(self.roots) if r == comm.rank]
        self._done: set[int] = set()
        self._next = 0
        self._receiving: list[int] = []
        self._sending: list[int] = []
        self.seconds = {"gradient_wait": 0.0, "gradient_transfer": 0.0}

    @property
    def active(self) -> bool:
        return self.comm.size > 1

    def post(self) -> None:
        """Start every receive of this step (before computing anything)."""
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self._done.clear()
        self._next = 0
        self._sending = []
        self._receiving = [layer for layer, r in enumerate(self.roots) if r != self.comm.rank]
        if self.active:
            for layer in self._receiving:
                self._request(layer).start()

    def send(self, layer: int, preconditioned: bool) -> None:
        """Layer ``layer`` (one of :attr:`mine`) is in its result: broadcast it once every
        earlier layer of this root has gone."""
        self.flags[layer].fill_(1.0 if preconditioned else 0.0)  # t[i] = x would copy from the host, waiting
        self._done.add(layer)
        while self._next < len(self.mine) and self.mine[self._next] in self._done:
            nxt = self.mine[self._next]
            self._next += 1
            if self.active:
                write_stamp(self.buffers[nxt].extra[1:], time.perf_counter() - self.epoch)
                self._request(nxt).start()
                self._sending.append(nxt)
        self.progress()

    def progress(self) -> None:
        if self.active:
            for layer in self._receiving + self._sending:
                self._request(layer).test()

    def finish(self) -> list[torch.Tensor]:
        """Wait for every result of the row; per layer, whether it was preconditioned (:attr:`flags`)."""
        for layer in self._receiving:
            start = time.perf_counter()
            self._request(layer).wait(
                f"K-FAC preconditioned gradient of layer {layer} from row rank {self.roots[layer]}"
            )
            end = time.perf_counter()
            stamp = self.buffers[layer].extra[1:]
            # A stamp on a device would cost a wait to read: there the whole interval counts as transfer.
            sent = self.epoch + read_stamp(stamp) if stamp.device.type == "cpu" else start
            waiting, transfer = split_blocked(start, end, sent)
            self.seconds["gradient_wait"] += waiting
            self.seconds["gradient_transfer"] += transfer
        start = time.perf_counter()
        for layer in self._sending:
            self._request(layer).wait(f"K-FAC preconditioned gradient of layer {layer}")
        self.seconds["gradient_transfer"] += time.perf_counter() - start
        return self.flags

    def _request(self, layer: int) -> Reusable:
        request = self._requests[layer]
        assert request is not None
        return request

    def close(self) -> None:
        for request in self._requests:
            if request is not None:
                request.free()
        self._requests = [None] * len(self._requests)
