"""Kernel dispatch: Numba's CPU kernels share the cores as torch does; bound kernels skip the dispatcher."""

import subprocess
import sys

import numpy as np
from numba import njit, types

from mpisolve.kernels.dispatch import bind

CHECK = """
import torch
from mpisolve.kernels.dispatch import parallel_threads
torch.set_num_threads(1)
assert parallel_threads() == 1
print(torch.get_num_threads())
"""


def test_starting_numbas_threads_leaves_torchs_thread_count_alone():
    """Numba's OpenMP layer resets the shared runtime's thread count when it starts; a rank
    given one thread by mpisolve.init must keep one (a fresh process: the layer starts once)."""
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["1"], out.stdout


@njit
def _axpy(x: np.ndarray, y: np.ndarray, index: int, a: float) -> float:
    y += a * x
    return y[index]


def test_a_bound_kernel_runs_the_overload_for_its_arguments_types():
    x, y = np.arange(4.0), np.zeros(4)
    call = bind(_axpy, x, y, 3, per_call=(types.float64,))
    assert call(2.0) == 6.0 and call(1.0) == 9.0 and y.tolist() == [0.0, 3.0, 6.0, 9.0]
    x32, y32 = np.arange(4, dtype=np.float32), np.zeros(4, dtype=np.float32)
    assert bind(_axpy, x32, y32, 1, per_call=(types.float64,))(0.5) == 0.5  # float32 arrays: their own overload
    assert y32.dtype == np.float32 and y32.tolist() == [0.0, 0.5, 1.0, 1.5]
    assert len(_axpy.overloads) == 2
