"""Numba's cache of the kernels: stale when any module of the package changes, absent (and
said once) where no location is writable. Each case runs fresh processes on a small package
laid out as ``mpisolve.kernels`` is (this package's ``caching`` module and two probes: one
kernel inlining another module's function, as ``slots`` inlines ``counters``).

Before the fix a kernel cached before a change to the module it inlines kept the old code
(Numba stamps a cache with the caller's file alone), and with no writable location the
import of every kernel failed: "cannot cache function ...: no locator available".
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mpisolve.kernels.caching as caching

INLINED = """from numba import njit

@njit(inline="always")
def value():
    return {value}
"""

CALLER = """from numba import njit

from .caching import CACHE
from .inlined import value


@njit(cache=CACHE)
def kernel():
    return value()
"""

RUN = "import sys, kprobe.caller as c; print(c.kernel(), c.kernel.stats.cache_hits.get((), 0), file=sys.stdout)"


def probe_package(root: Path, value: int) -> Path:
    package = root / "kprobe"
    package.mkdir()
    (package / "__init__.py").write_text("")
    shutil.copy(Path(caching.__file__), package / "caching.py")
    (package / "inlined.py").write_text(INLINED.format(value=value))
    (package / "caller.py").write_text(CALLER)
    return package


def run(root: Path, code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CACHE")}
    environment.update(PYTHONPATH=str(root), PYTHONWARNINGS="always", **env)
    done = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, cwd=root)
    assert done.returncode == 0, done.stderr
    return done


def test_a_change_to_an_inlined_module_recompiles_the_kernels_that_inline_it(tmp_path):
    package = probe_package(tmp_path, 1)
    assert run(tmp_path, RUN).stdout.split() == ["1", "0"]  # compiled and cached
    assert run(tmp_path, RUN).stdout.split() == ["1", "1"]  # loaded from the cache
    (package / "inlined.py").write_text(INLINED.format(value=2))  # the caller's own file unchanged
    assert run(tmp_path, RUN).stdout.split() == ["2", "0"]  # stale: compiled again


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc (a directory nobody may write into)")
def test_with_no_writable_cache_location_the_kernels_run_uncached_and_it_is_said_once(tmp_path):
    probe_package(tmp_path, 3)
    (tmp_path / "kprobe" / "__pycache__").write_text("")  # the package's __pycache__ cannot be a directory
    done = run(tmp_path, RUN, XDG_CACHE_HOME="/proc/mpisolve-no-cache", HOME="/proc/mpisolve-no-home")
    assert done.stdout.split() == ["3", "0"]
    assert done.stderr.count("no writable location for Numba's kernel cache") == 1, done.stderr
    # mpisolve itself, installed so: every solver imports and one trains.
    installed = tmp_path / "site"
    pycache = shutil.ignore_patterns("__pycache__")
    shutil.copytree(Path(caching.__file__).parents[1] / "mpisolve", installed / "mpisolve", ignore=pycache)
    kernels = installed / "mpisolve" / "kernels"  # installed as mpisolve.kernels
    shutil.copytree(Path(caching.__file__).parent, kernels, ignore=pycache)
    (kernels / "__pycache__").write_text("")
    train = (
        "import torch, mpisolve; from mpisolve.comm.communicator import Communicator; from mpi4py import MPI\n"
        "model = torch.nn.Linear(3, 2); solver = mpisolve.make_solver('allreduce', model, "
        "torch.optim.SGD(model.parameters(), lr=0.1), comm=Communicator(MPI.COMM_SELF))\n"
        "model(torch.ones(4, 3)).sum().backward(); print(solver.step().applied, sorted(mpisolve.solver_names()) != [])"
    )
    done = run(installed, train, XDG_CACHE_HOME="/proc/mpisolve-no-cache", HOME="/proc/mpisolve-no-home")
    assert done.stdout.split() == ["True", "True"]
    assert done.stderr.count("no writable location for Numba's kernel cache") == 1, done.stderr
