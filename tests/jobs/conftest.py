"""The ``slurm`` fixture: a real one-node Slurm for this directory's tests (slurm_cluster.py)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .slurm_cluster import SlurmCluster, ensure_slurm


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    ensure_slurm()
    # Not pytest's tmp_path: munged, running as the munge user, must reach its socket, and
    # pytest's base directory is private to root.
    cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="mpisolve-slurm-")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)
