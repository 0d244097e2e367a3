"""A flat buffer with a named tally: tensors laid end to end, and counts that travel with them.

Gradient buckets, a model's parameters, Adasum's deltas and K-FAC's factors move as one
flat buffer (:class:`FusedBuffer`: the tensors are views into it, so nothing is packed
twice), and each such message carries a few counts the ranks sum with it: the step's
samples, the ranks that contributed, the ranks still in their loops, a rank's speed. A
:class:`Tally` names those counts once (``Tally(samples=1, ranks=1)``) and says where
they live:

- :class:`HostTally`: counts the host writes and reads, never read back from a device:
  at the end of a CPU buffer (one message), else in a host buffer summed beside it.
- :class:`RidingTally`: counts that ride in the buffer's own message on its device (the
  gradient buckets'), read by the host through the step's one counted
  :class:`~.readback.Readback`, with the step's other device values.

:class:`TalliedBuffer` is the common case of the first: a flat buffer, a host tally, and
their sum; :func:`flatten_parameters` makes a model's parameters views into one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import UnsupportedModelError
from .communicator import Communicator
from .engine import Reusable
from .readback import Readback
from .reusable import reusable_sum

#: A single tensor under this many bytes is packed by one torch copy: the fused kernel's fixed
#: cost would lose there, and from a few MB on it copies faster (docs/studies/benchmarks.md).
ONE_COPY_BYTES = 1 << 20


class FusedBuffer:
    """Tensors of one dtype and device laid end to end; ``views[i]`` aliases tensor ``i``.

    ``extra`` adds that many trailing elements after the views (e.g. a sample count that
    rides along with the gradients). ``flat``: lay the views over this memory of at least
    that many elements instead of a new zeroed tensor (node-shared storage).
    """

    def __init__(
        self,
        shapes: Sequence[torch.Size],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        extra: int = 0,
        flat: torch.Tensor | None = None,
    ) -> None:
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [s.numel() for s in self.shapes]
        self.offsets: list[int] = []
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += n
        self.numel = total
        if flat is None:
            flat = torch.zeros(total + extra, dtype=dtype, device=device)
        elif flat.dtype != dtype or flat.numel() < total + extra:
            raise ValueError(f"storage of {flat.numel()} {flat.dtype} cannot hold {total + extra} {dtype}")
        self.flat = flat = flat[: total + extra]
        self.views = [flat[o : o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]
        self.extra = flat[total:]

    def pack(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy ``tensors`` into their places in the flat buffer.

        Tensors of the buffer's dtype and device move in one fused byte copy
        (``mpisolve.kernels.fused``: on the CPU faster than torch's copy on large buffers,
        ``bench kernels``, docs/studies/benchmarks.md; on a GPU one launch per 32 tensors on
        torch's current stream); others are copied (and cast) tensor by tensor by torch.
        """
        if [t.numel() for t in tensors] != self.numels:
            raise ValueError("pack needs tensors of the sizes the buffer was laid out for")
        if self._one_small(tensors):
            self.views[0].copy_(tensors[0].detach())
            return
        if self._fusable(tensors):
            from ..kernels.fused import pack

            pack([t.detach().contiguous() for t in tensors], self.flat)
            return
        for view, t in zip(self.views, tensors):
            view.copy_(t)

    def unpack(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy the flat buffer's pieces into ``tensors`` (of the sizes laid out), as :meth:`pack` moves them."""
        if [t.numel() for t in tensors] != self.numels:
            raise ValueError("unpack needs tensors of the sizes the buffer was laid out for")
        if not self._one_small(tensors) and self._fusable(tensors) and all(t.is_contiguous() for t in tensors):
            from ..kernels.fused import unpack

            unpack(self.flat, [t.detach() for t in tensors])
            torch.autograd.graph.increment_version(list(tensors))  # written behind autograd's back
            return
        for view, t in zip(self.views, tensors):
            t.detach().copy_(view)

    @staticmethod
    def _one_small(tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` is one tensor under :data:`ONE_COPY_BYTES` (moved by one torch copy)."""
        return len(tensors) == 1 and tensors[0].numel() * tensors[0].element_size() < ONE_COPY_BYTES

    def _fusable(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether the fused kernel moves ``tensors``: all of the buffer's dtype and device."""
        return all(t.dtype == self.flat.dtype and t.device == self.flat.device for t in tensors)


class Tally:
    """The named elements of a tally, in order: each name a count or a row of them (``speeds=ranks``).

    ``tally.at["samples"]`` is a name's first element, ``tally.span["speeds"]`` its slice.
    """

    def __init__(self, **widths: int) -> None:
        self.at: dict[str, int] = {}
        self.span: dict[str, slice] = {}
        size = 0
        for name, width in widths.items():
            self.at[name] = size
            self.span[name] = slice(size, size + width)
            size += width
        #: Elements in all.
        self.size = size


class HostTally:
    """A :class:`Tally`'s counts in host memory, summed over the ranks with a flat buffer's sum.

    The counts are host values, and the host needs their sums: they are never read back from
    a device. Beside a CPU ``wire`` they ride at its end (its last ``tally.size`` elements:
    one message, summed by the wire's own sum). Beside a device wire, or with none, they
    travel in a host buffer of their own, summed by :meth:`start` right after the wire's
    and :meth:`wait` after it. Write this rank's counts with :meth:`set`, read the sums with
    :meth:`count` (or :attr:`host`, a memoryview of their memory).
    """

    def __init__(self, comm: Communicator, tally: Tally, wire: torch.Tensor | None = None) -> None:
        self.tally = tally
        if wire is not None and wire.device.type == "cpu":
            self.values = wire[wire.numel() - tally.size :]
            self._own: Reusable | None = None
        else:
            self.values = torch.zeros(tally.size, dtype=torch.float64)
            self._own = reusable_sum(comm, self.values)
        self.host = self.values.numpy().data

    def set(self, name: str, value: int) -> None:
        """This rank's ``name`` count, before the sum starts."""
        self.host[self.tally.at[name]] = value

    def count(self, name: str) -> int:
        """The summed ``name`` count, after the sum (whole numbers in any float dtype: rounded)."""
        return int(round(self.host[self.tally.at[name]]))

    def start(self) -> None:
        """Start the counts' sum (where they have one of their own; riding ones go with the wire's)."""
        if self._own is not None:
            self._own.start()

    def wait(self, what: str) -> None:
        """Complete the counts' sum (after the wire's own wait)."""
        if self._own is not None:
            self._own.wait(what)

    def free(self) -> None:
        """Release the counts' own sum."""
        if self._own is not None:
            self._own.free()


class RidingTally:
    """A :class:`Tally` riding in a reduced message on its device, read through a step's :class:`Readback`.

    ``sent``: where this rank's counts go into the message; ``summed``: where their sums
    lie after the reduction (the same memory, but for a node-shared round's rows). The host
    writes this rank's counts through :meth:`set`, into ``sent`` itself where that is host
    memory, else into a pinned twin that :meth:`send` copies in without blocking (the
    previous step's copy is done: its step waited for its read-back since). The sums are
    read with the readback's one fetch: :meth:`stage` puts them into its slots from
    ``at`` on (nothing to do where ``summed`` is host memory), and :attr:`summed_host` is
    where the host finds them after the fetch.
    """

    def __init__(self, tally: Tally, sent: torch.Tensor, summed: torch.Tensor, readback: Readback, at: int = 0) -> None:
        self.tally = tally
        self._sent = sent
        on_host = sent.device.type == "cpu"
        self._twin = sent if on_host else torch.zeros(tally.size, dtype=sent.dtype).pin_memory()
        self._host = self._twin.numpy().data
        self.summed = summed
        self._slots = readback.values[at : at + tally.size]
        self._staged = summed.device.type != "cpu"
        #: The sums as the host reads them, after the readback's fetch.
        self.summed_host = readback.host[at : at + tally.size] if self._staged else summed.numpy().data

    def set(self, name: str, value: int) -> None:
        """This rank's ``name`` count, before :meth:`send`."""
        self._host[self.tally.at[name]] = value

    def send(self) -> None:
        """Put this rank's counts into the message (before its reduction starts)."""
        if self._twin is not self._sent:
            self._sent.copy_(self._twin, non_blocking=True)

    def stage(self) -> None:
        """Queue the sums' copy into the readback's slots (before its fetch)."""
        if self._staged:
            self._slots.copy_(self.summed)


class TalliedBuffer:
    """Tensors of one dtype and device laid end to end, a :class:`HostTally` after them, and their sum.

    :attr:`body` is the tensors' part of the flat buffer (:attr:`buffer`'s views alias it),
    :attr:`counts` the tally; :meth:`start` and :meth:`wait` sum both over the ranks in
    place (one message on the CPU). Built once; every round reuses it.
    """

    def __init__(self, comm: Communicator, buffer: FusedBuffer, counts: HostTally) -> None:
        self.buffer = buffer
        self.body = buffer.flat[: buffer.numel]
        self.counts = counts
        self._sum = reusable_sum(comm, buffer.flat)

    @classmethod
    def laid_out(
        cls, comm: Communicator, shapes: Sequence[torch.Size], dtype: torch.dtype, device: torch.device, tally: Tally
    ) -> TalliedBuffer:
        """A new zeroed buffer for tensors of ``shapes`` (the tally at its end on the CPU)."""
        buffer = FusedBuffer(shapes, dtype, device, extra=tally.size if device.type == "cpu" else 0)
        return cls(comm, buffer, HostTally(comm, tally, buffer.flat))

    @classmethod
    def of_parameters(
        cls, comm: Communicator, params: Sequence[torch.nn.Parameter], tally: Tally, *, who: str
    ) -> TalliedBuffer:
        """``params`` made views into a new buffer (:func:`flatten_parameters`), the tally after them."""
        extra = tally.size if params and params[0].device.type == "cpu" else 0
        buffer = flatten_parameters(params, who=who, extra=extra)
        return cls(comm, buffer, HostTally(comm, tally, buffer.flat))

    def start(self) -> None:
        """Start the sum of the tensors and the counts."""
        self._sum.start()
        self.counts.start()

    def wait(self, what: str) -> None:
        """Complete the sum started by :meth:`start`; ``what`` names it in a watchdog's report."""
        self._sum.wait(what)
        self.counts.wait(f"{what}'s tally")

    def free(self) -> None:
        """Release the sums."""
        self._sum.free()
        self.counts.free()


def flatten_parameters(
    params: Sequence[torch.nn.Parameter], *, who: str = "the EASGD family", extra: int = 0
) -> FusedBuffer:
    """Make ``params`` views into one flat buffer on their device (one copy, now) and return it.

    ``extra`` trailing elements follow the parameters (a tally's, on the CPU); ``who``
    names the solver in errors.
    """
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.float64}:
        found = ", ".join(sorted(map(str, dtypes)))
        raise UnsupportedModelError(f"{who} needs parameters of one dtype, float32 or float64; got {found}")
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise UnsupportedModelError(f"{who} needs parameters on one device; got {', '.join(sorted(map(str, devices)))}")
    flat = FusedBuffer([p.shape for p in params], params[0].dtype, params[0].device, extra=extra)
    flat.pack([p.detach() for p in params])
    for p, view in zip(params, flat.views):
        p.data = view
    return flat
