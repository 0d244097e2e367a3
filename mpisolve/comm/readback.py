"""The one place where the host reads values that live on the device.

A training step on a GPU runs ahead of the device as long as the host never waits for
it: every ``.item()``, ``.tolist()``, ``bool(tensor)`` or copy to pageable memory of a
CUDA tensor makes the host wait until everything queued before it has run. mpisolve's
solvers read what the host must know (the step's sample tally, whether the update is
finite, K-FAC's statuses) through a :class:`Readback`: values written into slots of one
small device vector by device operations, then read with one non-blocking copy into
pinned memory and one wait on an event, once per step. Every such wait, and every
one-off :func:`read`, is counted (:func:`host_reads`), so that tests can assert how many
times a solver's step waits on the device.

On the CPU the same calls read host memory: nothing is copied and nothing waits, but the
reads are counted all the same, so the count a CPU test sees is the count a GPU step has.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

_counter = threading.local()
#: Floating dtypes whose sums :func:`finite_probe` takes as they are; others (half precision) sum in float32.
_WIDE = (torch.float32, torch.float64)
_HALF = (torch.float16, torch.bfloat16)


def host_reads() -> int:
    """How many times this thread has read device values through this module (a CPU read counts too)."""
    return getattr(_counter, "reads", 0)


def reading() -> bool:
    """Whether this thread is inside one of this module's reads (a tool that flags other reads skips these)."""
    return getattr(_counter, "inside", False)


@contextmanager
def _read(device: torch.device) -> Iterator[None]:
    """One counted read; on a GPU its wait is allowed under ``torch.cuda.set_sync_debug_mode("error")``."""
    _counter.reads = getattr(_counter, "reads", 0) + 1
    _counter.inside = True
    mode = torch.cuda.get_sync_debug_mode() if device.type == "cuda" else 0
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        _counter.inside = False
        if mode:
            torch.cuda.set_sync_debug_mode(mode)


class Readback:
    """``size`` float64 values written on ``device`` and read by the host in one copy.

    Write the slots of :attr:`values` with device operations (``values[i:j].copy_(t)``,
    ``torch.linalg.vector_norm(..., out=...)``); :meth:`fetch` then copies them all to
    pinned host memory without blocking, waits once for that copy, and returns them as a
    memoryview. On the CPU, :attr:`values` is host memory and :meth:`fetch` only counts.
    The host copy is reused: read what you need from the memoryview before the next fetch.
    """

    def __init__(self, size: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.values = torch.zeros(size, dtype=torch.float64, device=self.device)
        self._cuda = self.device.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.float64, pin_memory=True) if self._cuda else self.values
        self._event = torch.cuda.Event() if self._cuda else None
        #: The host's copy of the values, as the last :meth:`fetch` left it.
        self.host = self._host.numpy().data

    def fetch(self) -> memoryview:
        """The values as the device work queued so far leaves them (one counted wait on a GPU)."""
        if self._event is None:  # host memory: only counted (once a step, where a context costs more than the rest)
            _counter.reads = getattr(_counter, "reads", 0) + 1
            return self.host
        with _read(self.device):
            self._host.copy_(self.values, non_blocking=True)
            self._event.record(torch.cuda.current_stream(self.device))
            self._event.synchronize()
        return self.host


def read(tensor: torch.Tensor) -> list[float]:
    """A one-off read of ``tensor``'s values (counted; one wait where it is on a GPU).

    For values the host needs outside a step's :class:`Readback` (a check at close, a
    measurement); a step's own reads go through its readback.
    """
    with _read(tensor.device):
        return tensor.detach().double().reshape(-1).tolist()


def wait_event(event: torch.cuda.Event, device: torch.device) -> None:
    """Wait for ``event`` (work queued on ``device`` before it): counted as a read, since the host
    learns the device's state."""
    with _read(device):
        event.synchronize()


def finite_probe(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-d tensor on ``tensors``' device, finite exactly when every element is (not read).

    A NaN or an Inf anywhere makes it NaN or Inf, so one read says whether a whole update
    is finite. The sum of each tensor's sum (:func:`_probe_sum`); on a GPU, several tensors
    (none in half precision) take the sum of their 2-norms instead, one ``_foreach_norm``
    launch per dtype where sums would take one each. Sums are taken in float32 at least;
    finite values whose sum (or squares) pass float32's range (3e38) read as not finite,
    which usable gradients never reach. Empty tensors sum to 0: finite. Tensors in host
    memory are better read by :func:`host_finite_probe`, which the functions below use.
    """
    if not tensors:
        return torch.zeros(())
    if len(tensors) > 1 and tensors[0].device.type == "cuda" and not any(t.dtype in _HALF for t in tensors):
        present = [t for t in tensors if t.numel() > 0]
        if present:
            return torch.stack(torch._foreach_norm(present, 2)).sum()
    sums = [_probe_sum(t) for t in tensors]
    return sums[0] if len(sums) == 1 else torch.stack(sums).sum()


def _probe_sum(t: torch.Tensor) -> torch.Tensor:
    """One tensor's sum for a finite probe: in its own dtype where that is float32 or float64 (no
    dtype argument to parse: a step's check is a handful of calls, and their overhead is part of
    its cost), else in float32."""
    return t.sum() if t.dtype in _WIDE else t.sum(dtype=torch.float32)


def host_finite_probe(tensors: Sequence[torch.Tensor]) -> float:
    """:func:`finite_probe`'s value for tensors in host memory, added up by the host as it takes each sum.

    On the CPU a sum's value is at hand: adding them in Python spares the stack, the sum of
    the sums and the copy into a slot, dispatches that cost a step as much as the pass over
    a small model's gradients. Each sum is :func:`_probe_sum`'s; the host
    adds them in float64, so a NaN or an Inf in any tensor makes the total NaN or Inf. The
    sums go from the last tensor to the first: given in the order an optimizer reads them
    (the parameters'), the first it reads are then the last the check brought into cache.
    """
    total = 0.0
    inside = reading()
    _counter.inside = True  # reads of host memory, which wait for nothing (not counted: the step's one read is)
    try:
        for t in reversed(tensors):
            total += float(_probe_sum(t))
    finally:
        _counter.inside = inside
    return total


def _on_host(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> bool:
    """Whether ``tensors`` (on one device) and ``out`` are host memory, whose sums the host may read as it goes."""
    return (out is None or out.device.type == "cpu") and (not tensors or tensors[0].device.type == "cpu")


def write_finite_probe(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Write :func:`finite_probe` of ``tensors`` (on one device) into ``out`` (one element, e.g. a
    :class:`Readback` slot), unread (on the CPU: :func:`host_finite_probe`)."""
    if _on_host(tensors, out):
        out.fill_(host_finite_probe(tensors))
    else:
        out.copy_(finite_probe(tensors))


def read_finite_probe(tensors: Sequence[torch.Tensor]) -> float:
    """:func:`finite_probe` of ``tensors`` (on one device), read: one counted read (on the CPU:
    :func:`host_finite_probe`, counted all the same)."""
    if _on_host(tensors):
        _counter.reads = getattr(_counter, "reads", 0) + 1
        return host_finite_probe(tensors)
    return read(finite_probe(tensors))[0]
