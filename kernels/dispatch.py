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
    numba.cuda and CuPy stay unimported on machines that never see one. The first tensor
    argument decides; mixing devices is an error.
    """
    module_name, _, function_name = gpu.partition(":")
    loaded: list[Callable[..., Any]] = []

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        devices = {a.device.type for a in args if isinstance(a, torch.Tensor)}
        if len(devices) > 1:
            raise ValueError(f"kernel arguments are on different devices: {sorted(devices)}")
        if devices == {"cuda"}:
            if not loaded:
                loaded.append(getattr(importlib.import_module(module_name), function_name))
            return loaded[0](*args, **kwargs)
        return cpu(*args, **kwargs)

    dispatch.__name__ = getattr(cpu, "__name__", "kernel")
    dispatch.__doc__ = cpu.__doc__
    return dispatch


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy) of a contiguous CPU tensor, for Numba CPU kernels."""
    return tensor.detach().numpy()


def device_array(tensor: torch.Tensor) -> Any:
    """A numba.cuda device-array view (no copy) of a contiguous CUDA tensor."""
    from numba import cuda

    return cuda.as_cuda_array(tensor.detach())


@dataclass(frozen=True)
class BenchCase:
    """One kernel against its plain torch/numpy equivalent on the same prepared data.

    Each kernel module exposes ``bench_cases(numel: int) -> list[BenchCase]``;
    ``python -m mpisolve bench kernels`` times both callables and prints their ratio.
    """

    name: str
    kernel: Callable[[], Any]
    reference: Callable[[], Any]
