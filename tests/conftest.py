"""Shared test configuration.

MPI tests carry ``@pytest.mark.mpi(min_size=N)`` (pytest-mpi) and run under
``mpiexec -n K python -m pytest --with-mpi``. ``@pytest.mark.ranks(2, 4)`` further
restricts a test to those exact world sizes, so the suite's MPI runs at 2, 3, 4, 5
and 8 ranks each execute only the tests meant for them. MPI tests without a ``ranks``
marker run at 2 and 4 ranks.
"""

from __future__ import annotations

import pytest

DEFAULT_SIZES = (2, 4)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ranks(*sizes): run this MPI test only at these world sizes")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _skip_gpu_tests_without_a_device(items)
    if not config.getoption("--with-mpi", default=False):
        return
    from mpi4py import MPI

    size = MPI.COMM_WORLD.Get_size()
    for item in items:
        if item.get_closest_marker("mpi") is None:
            continue
        marker = item.get_closest_marker("ranks")
        sizes = tuple(marker.args) if marker else DEFAULT_SIZES
        if size not in sizes:
            item.add_marker(pytest.mark.skip(reason=f"runs at {sizes} ranks, not {size}"))


def _skip_gpu_tests_without_a_device(items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if not torch.cuda.is_available():
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
