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
from numba import njit, types
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


@njit(nogil=True, cache=CACHE)
def _round(sums: tuple[Any, ...], seq: int, polls: int) -> bool:
    counters, rows, start, stop, out, scale, brain, tally_rows, tally_out = sums  # SlotRound.arguments()
    if not reached_within(counters, seq, polls):
        return False
    _sum_rows(rows, start, stop, out, scale, brain)
    _sum_float(tally_rows, 0, tally_out.shape[0], tally_out, 1.0)
    return True


@njit(nogil=True, cache=CACHE)
def _arrive(
    source: np.ndarray,
    slot: np.ndarray,
    tally: np.ndarray,
    tally_slot: np.ndarray,
    index: int,
    sums: tuple[Any, ...],
    seq: int,
) -> bool:
    for j in range(source.shape[0]):
        slot[j] = source[j]
    for j in range(tally.shape[0]):
        tally_slot[j] = tally[j]
    publish(sums[0], index, seq)
    return _round(sums, seq, 0)


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

    def __post_init__(self) -> None:
        _check_sum(self.rows, self.start, self.stop, self.out)
        tally_rows, tally_out = self.tally_rows, self.tally_out
        if tally_rows.dtype != np.float64 or tally_out.dtype != np.float64 or tally_rows.shape[1] < tally_out.shape[0]:
            raise TypeError(f"a tally is float64 rows of at least {tally_out.shape[0]} elements into float64")

    def arguments(self) -> tuple[Any, ...]:
        """The round's arguments as the compiled calls take them: one tuple, counters first."""
        return (
            self.counters,
            self.rows,
            int(self.start),
            int(self.stop),
            self.out,
            float(self.scale),
            bool(self.brain),
            self.tally_rows,
            self.tally_out,
        )


def round_sum(sums: SlotRound) -> Callable[[int, int], bool]:
    """A call ``(seq, polls) -> bool``: if every counter has reached ``seq`` (checked up to
    ``polls`` more times: :func:`mpisolve.kernels.counters.reached_within`), the round's sums,
    and True; else False, having done nothing. One compiled call for a round's wait and sums."""
    return bind(_round, sums.arguments(), per_call=(types.int64, types.int64))


def arrival(
    source: np.ndarray, slot: np.ndarray, tally: np.ndarray, tally_slot: np.ndarray, index: int, sums: SlotRound
) -> Callable[[int], bool]:
    """A call ``(seq) -> bool`` starting a round: copy ``source`` into ``slot`` and ``tally``
    into ``tally_slot``, publish ``sums.counters[index] = seq`` (release order:
    :func:`mpisolve.kernels.counters.publish`), then :func:`round_sum`'s call with no more
    polls (the rank that arrives last sums at once). One compiled call; checked once, here."""
    if source.shape != slot.shape or source.dtype != slot.dtype:
        raise ValueError(f"cannot copy {source.dtype}{source.shape} into {slot.dtype}{slot.shape}")
    if tally.shape != tally_slot.shape or tally.dtype != tally_slot.dtype:
        raise ValueError(f"cannot copy a tally of {tally.dtype}{tally.shape} into {tally_slot.dtype}{tally_slot.shape}")
    return bind(_arrive, source, slot, tally, tally_slot, int(index), sums.arguments(), per_call=(types.int64,))
