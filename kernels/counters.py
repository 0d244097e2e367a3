"""Counters in memory shared between processes: published with release order, read with acquire order.

A node-shared window's ranks synchronise through int64 counters (:class:`mpisolve.comm.shm.NodeCounters`):
a rank writes its data, then bumps its counter; another sees the counter reach a value,
then reads the data. The order both need is the C11 memory model's release store and
acquire load: every write before the store is visible to a process whose load sees the
stored value, and no read after the load is done before it. That is what
``MPI_Win_sync`` gives load/store access to a shared window in MPI's unified model (a
full memory barrier on the CPU), here without a call into MPI: on x86 both compile to
plain moves the compiler may not reorder, on Arm to ``stlr`` / ``ldar``.

Counters are one int64 each, at any stride (one per cache line), aligned to 8 bytes.

The same words serve as reader-writer locks between processes (:func:`try_lock_shared`,
:func:`try_lock_exclusive`, :func:`unlock_shared`, :func:`unlock_exclusive`: the locked
shared vectors of :mod:`mpisolve.comm.windows`), taken with an atomic compare-and-swap and
released with an atomic add, so no process's progress is needed to grant them. A word holds
its readers in the low 32 bits, :data:`WRITER` while a writer holds it, and
:data:`WAITING` per writer waiting for it: readers are not let in while a writer waits, so
readers that overlap one another cannot keep a writer out.
"""

from __future__ import annotations

import platform
from typing import Any

import numpy as np
from llvmlite import ir  # type: ignore[import-untyped]
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .caching import CACHE


def _item_pointer(context: Any, builder: Any, array_type: Any, array: Any, index_type: Any, index: Any) -> Any:
    ary = context.make_array(array_type)(context, builder, array)
    at = context.cast(builder, index, index_type, types.intp)
    return cgutils.get_item_pointer(context, builder, array_type, ary, [at], wraparound=False)


def _load_acquire_typing(typingctx: Any, counters: Any, index: Any) -> Any:  # noqa: ARG001 (Numba intrinsic signature)
    """``counters[index]`` read with acquire order."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        pointer = _item_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        return builder.load_atomic(pointer, "acquire", 8)

    return types.int64(counters, index), codegen


def _store_release_typing(typingctx: Any, counters: Any, index: Any, value: Any) -> Any:  # noqa: ARG001
    """``counters[index] = value`` with release order."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        pointer = _item_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        stored = context.cast(builder, args[2], signature.args[2], types.int64)
        builder.store_atomic(stored, pointer, "release", 8)
        return context.get_dummy_value()

    return types.void(counters, index, value), codegen


#: The CPU's spin-wait hint as an LLVM intrinsic (it lets a sibling hyperthread run and leaves
#: the loop without a memory-order flush), where there is one: x86's ``pause``, Arm's ``yield``.
_SPIN_HINT = {
    "x86_64": ("llvm.x86.sse2.pause", None),
    "AMD64": ("llvm.x86.sse2.pause", None),
    "aarch64": ("llvm.aarch64.hint", 1),
    "arm64": ("llvm.aarch64.hint", 1),
}.get(platform.machine())


def _spin_hint_typing(typingctx: Any) -> Any:  # noqa: ARG001
    """One spin-wait hint instruction (nothing where the CPU has none)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:  # noqa: ARG001
        if _SPIN_HINT is not None:
            name, operand = _SPIN_HINT
            arguments = [] if operand is None else [ir.IntType(32)]
            hint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), arguments), name)
            builder.call(hint, [] if operand is None else [ir.Constant(ir.IntType(32), operand)])
        return context.get_dummy_value()

    return types.void(), codegen


def _yield_cpu_typing(typingctx: Any) -> Any:  # noqa: ARG001
    """``sched_yield()``: give this core to another runnable process, if any."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:  # noqa: ARG001
        function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        builder.call(function, [])
        return context.get_dummy_value()

    return types.void(), codegen


def _compare_exchange_typing(typingctx: Any, words: Any, index: Any, expected: Any, desired: Any) -> Any:  # noqa: ARG001
    """Set ``words[index]`` to ``desired`` if it is ``expected``, atomically; the value found (acquire-release)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        pointer = _item_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        old = context.cast(builder, args[2], signature.args[2], types.int64)
        new = context.cast(builder, args[3], signature.args[3], types.int64)
        return builder.extract_value(builder.cmpxchg(pointer, old, new, "acq_rel", "acquire"), 0)

    return types.int64(words, index, expected, desired), codegen


def _fetch_add_typing(typingctx: Any, words: Any, index: Any, delta: Any) -> Any:  # noqa: ARG001
    """Add ``delta`` to ``words[index]``, atomically; the value before (acquire-release)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        pointer = _item_pointer(context, builder, signature.args[0], args[0], signature.args[1], args[1])
        added = context.cast(builder, args[2], signature.args[2], types.int64)
        return builder.atomic_rmw("add", pointer, added, "acq_rel")

    return types.int64(words, index, delta), codegen


_load_acquire: Any = intrinsic(_load_acquire_typing)
_compare_exchange: Any = intrinsic(_compare_exchange_typing)
_fetch_add: Any = intrinsic(_fetch_add_typing)
_store_release: Any = intrinsic(_store_release_typing)
_spin_hint: Any = intrinsic(_spin_hint_typing)
_yield_cpu: Any = intrinsic(_yield_cpu_typing)


@njit(nogil=True, cache=CACHE)
def publish(counters: np.ndarray, index: int, value: int) -> None:
    """Set ``counters[index]`` to ``value`` after every write this thread made before (release)."""
    _store_release(counters, index, value)


@njit(nogil=True, cache=CACHE)
def reached(counters: np.ndarray, value: int) -> bool:
    """Whether every counter is at least ``value``; if so, later reads see what was written before they were set."""
    for i in range(counters.shape[0]):
        if _load_acquire(counters, i) < value:
            return False
    return True


@njit(nogil=True, cache=CACHE)
def reached_one(counters: np.ndarray, index: int, value: int) -> bool:
    """Whether ``counters[index]`` is at least ``value`` (acquire, as :func:`reached`)."""
    return _load_acquire(counters, index) >= value


@njit(nogil=True, cache=CACHE)
def reached_within(counters: np.ndarray, value: int, polls: int, yielding: bool = False) -> bool:
    """:func:`reached`, checked again up to ``polls`` times with a spin-wait hint between (a bounded
    spin), or where ``yielding`` with ``sched_yield`` between (the core to a process that shares it)."""
    for _ in range(polls):
        if reached(counters, value):
            return True
        if yielding:
            _yield_cpu()
        else:
            _spin_hint()
    return reached(counters, value)


#: A lock word's value while a writer holds it (on top of the waiting writers' count).
WRITER = 1 << 32
#: What each writer waiting for a lock adds to its word.
WAITING = 1 << 40


@njit(nogil=True, cache=CACHE)
def compare_exchange(words: np.ndarray, index: int, expected: int, desired: int) -> int:
    """Set ``words[index]`` to ``desired`` if it holds ``expected``, atomically; the value it held."""
    return _compare_exchange(words, index, expected, desired)


@njit(nogil=True, cache=CACHE)
def fetch_add(words: np.ndarray, index: int, delta: int) -> int:
    """Add ``delta`` to ``words[index]``, atomically; the value it held."""
    return _fetch_add(words, index, delta)


@njit(nogil=True, cache=CACHE)
def try_lock_shared(words: np.ndarray, index: int) -> bool:
    """Join the readers of lock ``index`` unless a writer holds it or waits for it; whether this did."""
    seen = _load_acquire(words, index)
    return seen < WRITER and _compare_exchange(words, index, seen, seen + 1) == seen


@njit(nogil=True, cache=CACHE)
def try_lock_exclusive(words: np.ndarray, index: int, waiting: bool) -> bool:
    """Take lock ``index`` alone if nobody holds it; whether this did. ``waiting``: this writer
    was counted as waiting (:func:`fetch_add` of :data:`WAITING`), which taking it uncounts."""
    seen = _load_acquire(words, index)
    if seen % WAITING != 0:
        return False
    taken = seen + WRITER - (WAITING if waiting else 0)
    return _compare_exchange(words, index, seen, taken) == seen


@njit(nogil=True, cache=CACHE)
def unlock_shared(words: np.ndarray, index: int) -> None:
    """Leave the readers of lock ``index`` after every access this thread made under it."""
    _fetch_add(words, index, -1)


@njit(nogil=True, cache=CACHE)
def unlock_exclusive(words: np.ndarray, index: int) -> None:
    """Release lock ``index``, held alone, after every access this thread made under it."""
    _fetch_add(words, index, -WRITER)
