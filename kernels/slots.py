"""Summing the node's gradient slots: ``out[j] = scale * sum_r slots[r, j]`` over one range of ``j``.

The node-shared buckets (:mod:`mpisolve.comm.shm`) keep every local rank's copy of a
bucket in one row of a node-shared matrix; each rank sums the rows over its own share of
the columns, so the node's ranks reduce in parallel. The CPU kernel is one Numba loop
nest, single-threaded (the node's ranks are the parallelism), with no temporaries: it
works through the share in blocks that stay in L1, copying row 0 into ``out`` and adding
each further row into it, so every inner loop is a contiguous, vectorisable stream.

Accumulation order, the same for every element and on every rank and node:
``((slots[0] + slots[1]) + slots[2]) + ...`` in the output's dtype, then one multiply by
``scale`` (skipped when it is 1). float32 and float64 rows sum in their own dtype;
float16 and bfloat16 rows (passed as their raw 16-bit patterns) are widened exactly to
float32 and summed in float32, the caller rounding the float32 result to half once.
There is no GPU twin: node-shared windows hold host memory only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from llvmlite import ir  # type: ignore[import-untyped]
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .caching import CACHE
from .counters import publish, reached_within
from .dispatch import bind

#: Elements per block: one block of the output (float32: 8 KB) stays in L1 while every row is added into it.
BLOCK = 2048

#: 2**112: rescales a float16 pattern shifted into float32's fields to its value (normals and subnormals alike).
_HALF_RESCALE = np.float32(2.0**112)


def _float32_from_bits_typing(typingctx: Any, bits: Any) -> Any:  # noqa: ARG001 (Numba intrinsic signature)
    """Reinterpret a uint32 bit pattern as a float32 (no conversion)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:  # noqa: ARG001
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


_float32_from_bits: Any = intrinsic(_float32_from_bits_typing)


def _float64_from_bits_typing(typingctx: Any, bits: Any) -> Any:  # noqa: ARG001 (Numba intrinsic signature)
    """Reinterpret an int64 bit pattern as a float64 (no conversion)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:  # noqa: ARG001
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(types.int64), codegen


def _pointer_typing(typingctx: Any, address: Any) -> Any:  # noqa: ARG001 (Numba intrinsic signature)
    """An address (int64) as a pointer, for :func:`numba.carray`."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:  # noqa: ARG001
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(types.int64), codegen


_float64_from_bits: Any = intrinsic(_float64_from_bits_typing)
_pointer: Any = intrinsic(_pointer_typing)


@njit(inline="always")
def _widen_float16(h: np.uint16) -> np.float32:
    """The float32 equal to the float16 with bit pattern ``h`` (exact, signs, zeros, subnormals, inf, NaN)."""
    magnitude = np.uint32(h & 0x7FFF)
    value = _float32_from_bits(np.uint32(magnitude << 13)) * _HALF_RESCALE
    if (h & 0x7C00) == 0x7C00:  # inf or NaN: all exponent bits, mantissa kept
        value = _float32_from_bits(np.uint32(((magnitude & 0x3FF) << 13) | 0x7F800000))
    return -value if h & 0x8000 else value


@njit(inline="always")
def _widen_bfloat16(h: np.uint16) -> np.float32:
    """The float32 equal to the bfloat16 with bit pattern ``h`` (its upper half)."""
    return _float32_from_bits(np.uint32(np.uint32(h) << 16))


@njit(nogil=True, cache=CACHE)
def _sum_float(slots: np.ndarray, start: int, stop: int, out: np.ndarray, scale: float) -> None:
    rows = slots.shape[0]
    factor = out.dtype.type(scale)
    for block in range(start, stop, BLOCK):
        end = min(block + BLOCK, stop)
        # 1-D views of one block: contiguous loops LLVM vectorises (2-D indexing it does not).
        acc = out[block:end]
        first = slots[0, block:end]
        for j in range(acc.shape[0]):
            acc[j] = first[j]
        for r in range(1, rows):
            row = slots[r, block:end]
            for j in range(acc.shape[0]):
                acc[j] += row[j]
        if scale != 1.0:
            for j in range(acc.shape[0]):
                acc[j] *= factor


@njit(nogil=True, cache=CACHE)
def _sum_half(slots: np.ndarray, start: int, stop: int, out: np.ndarray, scale: float, brain: bool) -> None:
    rows = slots.shape[0]
    factor = np.float32(scale)
    for block in range(start, stop, BLOCK):
        end = min(block + BLOCK, stop)
        acc = out[block:end]
        for r in range(rows):
            row = slots[r, block:end]
            for j in range(acc.shape[0]):
                value = _widen_bfloat16(row[j]) if brain else _widen_float16(row[j])
                if r == 0:
                    acc[j] = value
                else:
                    acc[j] += value
        if scale != 1.0:
            for j in range(acc.shape[0]):
                acc[j] *= factor


def _sum_rows(slots: np.ndarray, start: int, stop: int, out: np.ndarray, scale: float, brain: bool) -> None:
    """:func:`_sum_half` for rows of half-precision patterns, else :func:`_sum_float` (chosen when compiled)."""
    raise NotImplementedError("compiled code only")


@overload(_sum_rows, jit_options={"nogil": True})
def _sum_rows_by_dtype(slots: Any, start: Any, stop: Any, out: Any, scale: Any, brain: Any) -> Any:  # noqa: ARG001
    # The implementations' parameters must be annotated as these are: Numba compares the signatures.
    if slots.dtype == types.uint16:

        def half(slots: Any, start: Any, stop: Any, out: Any, scale: Any, brain: Any) -> Any:
            _sum_half(slots, start, stop, out, scale, brain)

        return half

    def full(slots: Any, start: Any, stop: Any, out: Any, scale: Any, brain: Any) -> Any:  # noqa: ARG001
        _sum_float(slots, start, stop, out, scale)

    return full


# A round's compiled calls take its arrays as one int64 vector of addresses, shapes and scalars
# (:meth:`SlotRound.layout`, :func:`arrival`): a call unboxes one array, not nine, and the arrays
# are rebuilt inside as views of the same memory. Positions in that vector:
_COUNTERS, _COUNTERS_N, _COUNTERS_STEP = 0, 1, 2  # address, how many, elements from one to the next
_ROWS, _ROWS_R, _ROWS_M, _START, _STOP, _OUT, _OUT_N, _SCALE, _KIND = 3, 4, 5, 6, 7, 8, 9, 10, 11
_TALLY_ROWS, _TALLY_ROWS_R, _TALLY_ROWS_M, _TALLY_OUT, _TALLY_N, _YIELDING = 12, 13, 14, 15, 16, 17
_SOURCE, _SOURCE_BYTES, _SLOT, _TALLY, _TALLY_SLOT, _TALLY_IN_N, _INDEX, _SUMS = 18, 19, 20, 21, 22, 23, 24, 25
_ROUND_SIZE, _ARRIVAL_SIZE = 18, 26
#: ``_KIND``: what the rows hold.
_FLOAT32, _FLOAT64, _FLOAT16, _BFLOAT16 = 0, 1, 2, 3


@njit(nogil=True, cache=CACHE)
def _counters_at(at: np.ndarray) -> np.ndarray:
    step = at[_COUNTERS_STEP]
    extent = (at[_COUNTERS_N] - 1) * step + 1
    return carray(_pointer(at[_COUNTERS]), (extent,), np.int64)[::step]


@njit(nogil=True, cache=CACHE)
def _sums_at(at: np.ndarray) -> None:
    start, stop, kind, scale = at[_START], at[_STOP], at[_KIND], _float64_from_bits(at[_SCALE])
    shape, n = (at[_ROWS_R], at[_ROWS_M]), at[_OUT_N]
    if kind == _FLOAT32:
        rows32 = carray(_pointer(at[_ROWS]), shape, np.float32)
        _sum_float(rows32, start, stop, carray(_pointer(at[_OUT]), (n,), np.float32), scale)
    elif kind == _FLOAT64:
        rows64 = carray(_pointer(at[_ROWS]), shape, np.float64)
        _sum_float(rows64, start, stop, carray(_pointer(at[_OUT]), (n,), np.float64), scale)
    else:
        rows16 = carray(_pointer(at[_ROWS]), shape, np.uint16)
        _sum_half(rows16, start, stop, carray(_pointer(at[_OUT]), (n,), np.float32), scale, kind == _BFLOAT16)
    tally_rows = carray(_pointer(at[_TALLY_ROWS]), (at[_TALLY_ROWS_R], at[_TALLY_ROWS_M]), np.float64)
    tally_out = carray(_pointer(at[_TALLY_OUT]), (at[_TALLY_N],), np.float64)
    _sum_float(tally_rows, 0, tally_out.shape[0], tally_out, 1.0)


@njit(nogil=True, cache=CACHE)
def _reached(at: np.ndarray, seq: int, polls: int) -> bool:
    """Whether the layout's counters reached ``seq``, checked up to ``polls`` more times (yielding where it says)."""
    return reached_within(_counters_at(at), seq, polls, at[_YIELDING] != 0)


@njit(nogil=True, cache=CACHE)
def _round(at: np.ndarray, seq: int, polls: int) -> bool:
    if not _reached(at, seq, polls):
        return False
    _sums_at(at)
    return True


@njit(nogil=True, cache=CACHE)
def _copy_bytes_and_tally(at: np.ndarray) -> None:
    """The layout's source into its slot (raw bytes: any dtype) and its tally into the tally's slot."""
    n, t = at[_SOURCE_BYTES], at[_TALLY_IN_N]
    source = carray(_pointer(at[_SOURCE]), (n,), np.uint8)
    slot = carray(_pointer(at[_SLOT]), (n,), np.uint8)
    for j in range(n):
        slot[j] = source[j]
    tally = carray(_pointer(at[_TALLY]), (t,), np.float64)
    tally_slot = carray(_pointer(at[_TALLY_SLOT]), (t,), np.float64)
    for j in range(t):
        tally_slot[j] = tally[j]


@njit(nogil=True, cache=CACHE)
def _arrive(at: np.ndarray, seq: int) -> bool:
    _copy_bytes_and_tally(at)
    publish(_counters_at(at), at[_INDEX], seq)
    return bool(at[_SUMS]) and _round(at, seq, 0)


@njit(nogil=True, cache=CACHE)
def _copy_published(at: np.ndarray, seq: int, polls: int) -> bool:
    if not _reached(at, seq, polls):
        return False
    _copy_bytes_and_tally(at)
    return True


def host_rows(slots: torch.Tensor) -> np.ndarray:
    """The numpy view :func:`slot_sum` takes of a 2-D CPU tensor of slots (half as raw uint16)."""
    if slots.dtype in (torch.float16, torch.bfloat16):
        return slots.detach().view(torch.int16).numpy().view(np.uint16)
    return slots.detach().numpy()


def slot_sum(
    rows: np.ndarray, start: int, stop: int, out: np.ndarray, scale: float = 1.0, *, brain: bool = False
) -> Callable[[], None]:
    """A call computing ``out[start:stop] = scale * sum over r of rows[r, start:stop]``, in the order the module states.

    ``rows``: a C-contiguous (ranks, m) array from :func:`host_rows` (float32, float64, or
    uint16 patterns of float16 / bfloat16 when ``brain``); ``out``: float32 for half rows,
    else the rows' dtype. The arguments are checked once, here: a round calls the result
    (which allocates nothing) with no check of its own.
    """
    _check_sum(rows, start, stop, out)
    if rows.dtype == np.uint16:
        return bind(_sum_half, rows, int(start), int(stop), out, float(scale), bool(brain))
    return bind(_sum_float, rows, int(start), int(stop), out, float(scale))


def _check_sum(rows: np.ndarray, start: int, stop: int, out: np.ndarray) -> None:
    if not 0 <= start <= stop <= min(rows.shape[1], out.shape[0]):
        raise ValueError(f"range {start}:{stop} is outside rows of {rows.shape[1]} / out of {out.shape[0]} elements")
    if rows.dtype == np.uint16:
        if out.dtype != np.float32:
            raise TypeError(f"half rows sum into float32, got out of {out.dtype}")
    elif out.dtype != rows.dtype:
        raise TypeError(f"rows of {rows.dtype} sum into {rows.dtype}, got out of {out.dtype}")


@dataclass(frozen=True, eq=False)
class SlotRound:
    """One round's sum over a node's slots, checked once, here (its calls check nothing).

    Once every one of ``counters`` has reached the round's number (acquire order:
    :mod:`mpisolve.kernels.counters`), ``out[start:stop] = scale * sum over r of
    rows[r, start:stop]``, as :func:`slot_sum` (``rows`` from :func:`host_rows`, ``out``
    float32 for half rows, ``brain`` for bfloat16 patterns), and the float64
    ``tally_rows`` (ranks, >= t) are summed into ``tally_out`` (t), unscaled.
    """

    counters: np.ndarray
    rows: np.ndarray
    start: int
    stop: int
    out: np.ndarray
    tally_rows: np.ndarray
    tally_out: np.ndarray
    scale: float = 1.0
    brain: bool = False
    yielding: bool = False

    def __post_init__(self) -> None:
        _check_sum(self.rows, self.start, self.stop, self.out)
        tally_rows, tally_out = self.tally_rows, self.tally_out
        if tally_rows.dtype != np.float64 or tally_out.dtype != np.float64 or tally_rows.shape[1] < tally_out.shape[0]:
            raise TypeError(f"a tally is float64 rows of at least {tally_out.shape[0]} elements into float64")
        if self.rows.dtype not in (np.float32, np.float64, np.uint16):
            raise TypeError(f"rows are float32, float64 or half patterns (uint16), got {self.rows.dtype}")
        _require_contiguous(rows=self.rows, out=self.out, tally_rows=tally_rows, tally_out=tally_out)
        _check_counters(self.counters)

    def layout(self, size: int = _ROUND_SIZE) -> np.ndarray:
        """The round as its compiled calls take it: ``size`` int64s of addresses, shapes and
        scalars (the positions of :data:`_COUNTERS` and the like; the rest zeros)."""
        kind = {np.float32: _FLOAT32, np.float64: _FLOAT64}.get(
            self.rows.dtype.type, _BFLOAT16 if self.brain else _FLOAT16
        )
        at = np.zeros(size, dtype=np.int64)
        _set_counters(at, self.counters)
        at[[_ROWS, _ROWS_R, _ROWS_M, _START, _STOP]] = _address(self.rows), *self.rows.shape, self.start, self.stop
        at[[_OUT, _OUT_N, _KIND]] = _address(self.out), self.out.size, kind
        at[_SCALE] = np.float64(self.scale).view(np.int64)
        at[[_TALLY_ROWS, _TALLY_ROWS_R, _TALLY_ROWS_M]] = _address(self.tally_rows), *self.tally_rows.shape
        at[[_TALLY_OUT, _TALLY_N]] = _address(self.tally_out), self.tally_out.size
        at[_YIELDING] = self.yielding
        return at

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The arrays the layout points into (a call holds them)."""
        return self.counters, self.rows, self.out, self.tally_rows, self.tally_out


def _address(array: np.ndarray) -> int:
    return int(array.ctypes.data)


def _require_contiguous(**arrays: np.ndarray) -> None:
    for name, array in arrays.items():
        if not array.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")


def round_sum(sums: SlotRound) -> Callable[[int, int], bool]:
    """A call ``(seq, polls) -> bool``: if every counter has reached ``seq`` (checked up to
    ``polls`` more times: :func:`mpisolve.kernels.counters.reached_within`, yielding between where
    the round is ``yielding``), the round's sums,
    and True; else False, having done nothing. One compiled call for a round's wait and sums."""
    return bind(_round, sums.layout(), per_call=(types.int64, types.int64), keep=sums.arrays())


def arrival(
    source: np.ndarray,
    slot: np.ndarray,
    tally: np.ndarray,
    tally_slot: np.ndarray,
    index: int,
    sums: SlotRound,
    *,
    sum_at_arrival: bool = True,
) -> Callable[[int], bool]:
    """A call ``(seq) -> bool`` starting a round: copy ``source`` into ``slot`` and ``tally``
    into ``tally_slot``, publish ``sums.counters[index] = seq`` (release order:
    :func:`mpisolve.kernels.counters.publish`), then, if ``sum_at_arrival``, :func:`round_sum`'s
    call with no more polls (the rank that arrives last sums at once; else False). One compiled
    call; checked once, here."""
    _check_copy(source, slot, tally, tally_slot)
    if not 0 <= index < sums.counters.size:
        raise ValueError(f"index {index} names no counter of {sums.counters.size}")
    at = sums.layout(_ARRIVAL_SIZE)
    _set_copy(at, source, slot, tally, tally_slot)
    at[[_INDEX, _SUMS]] = index, sum_at_arrival
    keep = (*sums.arrays(), source, slot, tally, tally_slot)
    return bind(_arrive, at, per_call=(types.int64,), keep=keep)


def publication(
    source: np.ndarray,
    destination: np.ndarray,
    tally: np.ndarray,
    tally_destination: np.ndarray,
    counters: np.ndarray,
    index: int,
) -> Callable[[int], object]:
    """A call ``(seq)`` publishing a result: copy ``source`` into ``destination`` and ``tally``
    into ``tally_destination``, then set ``counters[index] = seq`` (release order), where
    :func:`published_copy` waits for it. One compiled call; checked once, here."""
    _check_copy(source, destination, tally, tally_destination)
    _check_counters(counters)
    if not 0 <= index < counters.size:
        raise ValueError(f"index {index} names no counter of {counters.size}")
    at = np.zeros(_ARRIVAL_SIZE, dtype=np.int64)
    _set_counters(at, counters)
    _set_copy(at, source, destination, tally, tally_destination)
    at[_INDEX] = index
    keep = (counters, source, destination, tally, tally_destination)
    return bind(_arrive, at, per_call=(types.int64,), keep=keep)  # _SUMS 0: copied and published, no sum


def published_copy(
    counter: np.ndarray,
    source: np.ndarray,
    destination: np.ndarray,
    tally: np.ndarray,
    tally_destination: np.ndarray,
    *,
    yielding: bool = False,
) -> Callable[[int, int], bool]:
    """A call ``(seq, polls) -> bool``: once ``counter`` (a vector of one int64 from a node-shared
    window) has reached ``seq`` (checked up to ``polls`` more times, acquire order, yielding the core
    between checks where ``yielding``), copy ``source`` into ``destination`` and ``tally`` into
    ``tally_destination``, and True; else False, having done nothing. How a node's ranks take a
    result one rank published. Checked once, here."""
    _check_copy(source, destination, tally, tally_destination)
    if counter.dtype != np.int64 or counter.shape != (1,):
        raise TypeError(f"the counter is a vector of one int64, got {counter.dtype}{counter.shape}")
    at = np.zeros(_ARRIVAL_SIZE, dtype=np.int64)
    _set_counters(at, counter)
    _set_copy(at, source, destination, tally, tally_destination)
    at[_YIELDING] = yielding
    keep = (counter, source, destination, tally, tally_destination)
    return bind(_copy_published, at, per_call=(types.int64, types.int64), keep=keep)


def _check_copy(source: np.ndarray, destination: np.ndarray, tally: np.ndarray, tally_destination: np.ndarray) -> None:
    if source.shape != destination.shape or source.dtype != destination.dtype:
        raise ValueError(f"cannot copy {source.dtype}{source.shape} into {destination.dtype}{destination.shape}")
    if tally.shape != tally_destination.shape or tally.dtype != tally_destination.dtype:
        raise ValueError(
            f"cannot copy a tally of {tally.dtype}{tally.shape} into {tally_destination.dtype}{tally_destination.shape}"
        )
    if tally.dtype != np.float64 or tally.ndim != 1:
        raise TypeError(f"a tally is a vector of float64, got {tally.dtype}{tally.shape}")
    _require_contiguous(source=source, destination=destination, tally=tally, tally_destination=tally_destination)


def _set_copy(
    at: np.ndarray, source: np.ndarray, destination: np.ndarray, tally: np.ndarray, tally_destination: np.ndarray
) -> None:
    """A layout's copy (:func:`_copy_bytes_and_tally`): ``source``'s bytes and ``tally`` into their destinations."""
    at[[_SOURCE, _SOURCE_BYTES, _SLOT]] = _address(source), source.nbytes, _address(destination)
    at[[_TALLY, _TALLY_SLOT, _TALLY_IN_N]] = _address(tally), _address(tally_destination), tally.size


def _check_counters(counters: np.ndarray) -> None:
    if counters.dtype != np.int64 or counters.ndim != 1 or not counters.size or counters.strides[0] % 8:
        raise TypeError("counters are a vector of int64, one every whole number of int64s")
    if counters.strides[0] <= 0:
        raise ValueError("counters must lie in increasing addresses")


def _set_counters(at: np.ndarray, counters: np.ndarray) -> None:
    """A layout's counters: their address, how many, and the int64s from one to the next."""
    at[[_COUNTERS, _COUNTERS_N, _COUNTERS_STEP]] = _address(counters), counters.size, counters.strides[0] // 8
