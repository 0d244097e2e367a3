"""Shared test configuration.

MPI tests carry ``@pytest.mark.mpi(min_size=N)`` (pytest-mpi) and run under
``mpiexec -n K python -m pytest --with-mpi``. ``@pytest.mark.ranks(2, 4)`` further
restricts a test to those exact world sizes, so the suite's MPI runs at 2, 3, 4, 5
and 8 ranks each execute only the tests meant for them. MPI tests without a ``ranks``
marker run at 2 and 4 ranks. On the emulated 2-node cluster (``make test-cluster``,
``MPISOLVE_EMULATED_CLUSTER=1``) the tests marked ``cluster`` run, whatever the size.
"""

from __future__ import annotations

import os

import pytest
import torch

DEFAULT_SIZES = (2, 4)

# Without a GPU, numba.cuda kernels run on the CPU under Numba's CUDA simulator, so the
# GPU twins are tested against their CPU twins everywhere; with one, the same tests run
# on the device, and so do the tests marked gpu (a NUMBA_ENABLE_CUDASIM=1 left in the
# environment would hand them the simulator: it is removed). Set before any test module
# imports numba.
if torch.cuda.is_available():
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
else:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

# Node-shared sums from the first byte: the suite's small models and tensors exercise the node
# path as large ones take it; the tests of the crossover itself set it (MPISOLVE_NODE_SHM_MIN_BYTES).
os.environ.setdefault("MPISOLVE_NODE_SHM_MIN_BYTES", "0")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ranks(*sizes): run this MPI test only at these world sizes")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    config.addinivalue_line("markers", "gpu: needs a CUDA device; runs whenever CUDA is present, skipped without it")
    config.addinivalue_line("markers", "cluster: also runs on the emulated 2-node cluster (make test-cluster)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _skip_gpu_tests_without_a_device(items)
    if not config.getoption("--with-mpi", default=False):
        return
    from mpi4py import MPI

    size = MPI.COMM_WORLD.Get_size()
    emulated = os.environ.get("MPISOLVE_EMULATED_CLUSTER") == "1"
    for item in items:
        if item.get_closest_marker("mpi") is None:
            continue
        if emulated:  # tests/cluster/: the tests marked for it, at whatever size the cluster has
            if item.get_closest_marker("cluster") is None:
                item.add_marker(pytest.mark.skip(reason="not marked to run on the emulated cluster"))
            continue
        marker = item.get_closest_marker("ranks")
        sizes = tuple(marker.args) if marker else DEFAULT_SIZES
        if size not in sizes:
            item.add_marker(pytest.mark.skip(reason=f"runs at {sizes} ranks, not {size}"))


def _skip_gpu_tests_without_a_device(items: list[pytest.Item]) -> None:
    """Tests marked gpu run whenever CUDA is present, and skip only without it."""
    if torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
