"""Choosing the CPU or GPU twin of a kernel by the device of the tensors it is given."""

from __future__ import annotations

import importlib
from collections.abc import Callable
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


def device_array(tensor: torch.Tensor, *, sync: bool = True) -> Any:
    """A numba.cuda device-array view (no copy) of a contiguous CUDA tensor.

    With ``sync`` (Numba's default) the host first waits for the stream the tensor was
    exported on. Kernels launched on :func:`launch_stream` are ordered after the work
    that produced the tensor anyway, so they pass ``sync=False`` and skip that wait.
    """
    from numba import cuda

    return cuda.as_cuda_array(tensor.detach(), sync=sync)


def launch_stream(tensor: torch.Tensor) -> Any:
    """torch's current stream on ``tensor``'s device, as a Numba stream to launch kernels on."""
    from numba import cuda

    return cuda.external_stream(torch.cuda.current_stream(tensor.device).cuda_stream)


@dataclass(frozen=True)
class BenchCase:
    """One kernel against its plain torch/numpy equivalent on the same prepared data.

    Each kernel module exposes ``bench_cases(numel: int) -> list[BenchCase]``;
    ``python -m mpisolve bench kernels`` times both callables and prints their ratio.
    """

    name: str  # the operation and its data, e.g. "pack 4 tensors"; the bench prefixes the module
    kernel: Callable[[], Any]
    reference: Callable[[], Any]
