"""Calling kernels: the CPU or GPU twin by the device of the tensors given; a CPU kernel bound to its arrays."""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def by_device(cpu: Callable[..., Any], gpu: str) -> Callable[..., Any]:
    """A function that runs ``cpu`` for CPU tensors and ``gpu`` for CUDA tensors.

    ``gpu`` is ``"module:function"``, imported on first use with a CUDA tensor, so that
    numba.cuda and CuPy stay unimported on machines that never see one. The tensor
    arguments (also inside a list or tuple argument) decide; mixing devices, or a device
    other than the CPU and CUDA, is an error.
    """
    module_name, _, function_name = gpu.partition(":")
    loaded: list[Callable[..., Any]] = []

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        tensors = _tensors(args)
        on_gpu = {t.is_cuda for t in tensors}
        if len(on_gpu) > 1:
            raise ValueError("kernel arguments are on different devices: some on a GPU, some not")
        if on_gpu == {True}:
            if not loaded:
                loaded.append(getattr(importlib.import_module(module_name), function_name))
            return loaded[0](*args, **kwargs)
        if not all(t.is_cpu for t in tensors):
            raise ValueError("kernels take CPU or CUDA tensors only")
        return cpu(*args, **kwargs)

    dispatch.__name__ = getattr(cpu, "__name__", "kernel")
    dispatch.__doc__ = cpu.__doc__
    return dispatch


class Bound(functools.partial[Any]):
    """:func:`bind`'s call, holding :attr:`keep`: what must outlive it (the memory of addresses it was given)."""

    keep: tuple[Any, ...]


def bind(kernel: Any, *fixed: Any, per_call: tuple[Any, ...] = (), keep: tuple[Any, ...] = ()) -> Callable[..., Any]:
    """``kernel`` (a Numba CPU function) with its leading arguments ``fixed``, called past the dispatcher.

    A call through Numba's dispatcher types every argument each time, which can cost more
    than a small round's whole work on a hot path
    that calls one kernel with the same arrays every time. Here the overload for the
    types of ``fixed`` and ``per_call`` (the Numba types of the arguments given at each
    call) is compiled, or loaded from Numba's cache, once; the call goes straight to its
    compiled wrapper, which only unboxes. Nothing checks a call's arguments: each must be
    of its ``per_call`` type (a scalar of another type is converted, a float to ``int64``
    truncated; an array of another dtype or dimension would be misread), so bind scalars
    per call, arrays up front. The callers check the bound arguments (e.g.
    :class:`mpisolve.kernels.slots.SlotRound`). ``keep``: objects the call holds as long as it
    lives (the arrays a vector of addresses among ``fixed`` points into).
    """
    import numba

    signature = tuple(numba.typeof(a) for a in fixed) + tuple(per_call)
    call = Bound(kernel.compile(signature), *fixed)
    call.keep = keep
    return call


def _tensors(args: tuple[Any, ...]) -> list[torch.Tensor]:
    found = []
    for a in args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(t for t in a if isinstance(t, torch.Tensor))
    return found


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy) of a contiguous CPU tensor, for Numba CPU kernels."""
    return tensor.detach().numpy()


def parallel_threads() -> int:
    """Make Numba's parallel kernels use as many threads as torch's intra-op pool.

    ``mpisolve.init`` gives each rank its share of the node's cores through
    ``torch.set_num_threads``; CPU kernels follow it so ranks do not oversubscribe cores.
    Starting Numba's threading layer (its first ``set_num_threads``) sets the OpenMP
    runtime's thread count to all the machine's cores; with the ``omp`` layer that runtime
    is the one torch reads, so torch's count is put back afterwards.
    """
    import numba

    torch_threads = torch.get_num_threads()
    threads = max(1, min(torch_threads, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]  # numba's config sets its attributes at run time
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
    return threads


def simulating() -> bool:
    """Whether numba.cuda is Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, the suite without a GPU).

    The GPU twins' torch-facing functions then take CPU tensors, which stand for device
    ones: the same argument handling, device arrays and launches run on the CPU.
    """
    import numba

    return bool(getattr(numba.config, "ENABLE_CUDASIM", False))


def _kernel_tensor(tensor: torch.Tensor) -> None:
    if not (tensor.is_cuda or (tensor.is_cpu and simulating())):
        raise ValueError(
            f"GPU kernels take CUDA tensors (CPU ones under the CUDA simulator), got one on {tensor.device}"
        )


def device_array(tensor: torch.Tensor) -> Any:
    """A numba.cuda array viewing a contiguous CUDA tensor's memory: no copy, no synchronization.

    Kernels launched on :func:`launch_stream` are ordered after the work that produced the
    tensor, so nothing waits here (Numba's own ``sync=True`` would block the host on the
    tensor's stream). Under the simulator, a numpy view of a CPU tensor.
    """
    _kernel_tensor(tensor)
    if tensor.is_cuda:
        from numba import cuda

        return cuda.as_cuda_array(tensor.detach(), sync=False)
    return tensor.detach().numpy()


def launch_stream(tensor: torch.Tensor) -> Any:
    """torch's current stream on ``tensor``'s device, as a Numba stream to launch kernels on.

    Under the simulator, a simulated stream (every simulated launch runs at once).
    """
    _kernel_tensor(tensor)
    from numba import cuda

    if tensor.is_cuda:
        return cuda.external_stream(torch.cuda.current_stream(tensor.device).cuda_stream)
    return cuda.stream()


@contextlib.contextmanager
def on_device(tensor: torch.Tensor) -> Iterator[None]:
    """numba.cuda's current device set to ``tensor``'s GPU for the duration (the simulator has one)."""
    _kernel_tensor(tensor)
    from numba import cuda

    with cuda.gpus[tensor.device.index if tensor.is_cuda else 0]:
        yield


@dataclass(frozen=True)
class BenchCase:
    """One kernel against its plain torch/numpy equivalent on the same prepared data.

    Each kernel module exposes ``bench_cases(numel: int, device="cpu") -> list[BenchCase]``;
    ``python -m mpisolve bench kernels`` times both callables and prints their ratio.
    """

    name: str  # the operation and its data, e.g. "pack 4 tensors"; the bench prefixes the module
    kernel: Callable[[], Any]
    reference: Callable[[], Any]
