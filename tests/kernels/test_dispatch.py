"""Kernel dispatch: Numba's CPU kernels share the cores as torch does."""

import subprocess
import sys

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
