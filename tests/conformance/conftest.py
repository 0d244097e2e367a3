"""The conformance suite's communicator: one per test module, with a short watchdog, so that
an idiom that would hang fails the test (CommTimeout) instead.

The bucket solvers whose sums are node-shared where ranks share a node (``allreduce``,
``kfac``; :mod:`mpisolve.comm.shm`) run on it here, as they do by default: at 2 ranks and
on the emulated 2x2 cluster (``make test-cluster``) every node-shared sum takes the
bandwidth path (the sum read in place from the window, the path whose results the node's
ranks share), at other sizes the path these tiny models take by default (the latency
path, each rank's own result; on the emulated 2x3 cluster the sum each node's leader
exchanges and publishes).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from mpi4py import MPI

from mpisolve.comm import shm
from mpisolve.comm.communicator import Communicator

#: Seconds before a wait in these tests gives up (every idiom here completes in well under one).
TIMEOUT_S = 60.0

#: Whether node-shared sums of any size take the bandwidth path in this run.
BANDWIDTH_PATH = MPI.COMM_WORLD.Get_size() == 2 or (
    os.environ.get("MPISOLVE_EMULATED_CLUSTER") == "1" and MPI.COMM_WORLD.Get_size() == 4
)


@pytest.fixture(scope="module", autouse=True)
def node_shared_path() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        if BANDWIDTH_PATH:
            patch.setattr(shm, "LATENCY_MAX_BYTES", 0)
        yield


@pytest.fixture(scope="module")
def comm() -> Communicator:
    return Communicator(timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def mpi_path() -> Communicator:
    """A communicator whose sums all take MPI's own path (no node-shared memory)."""
    return Communicator(timeout_s=TIMEOUT_S, node_shm=False)


@pytest.fixture(params=["node-shared", "mpi"])
def on(request: pytest.FixtureRequest, comm: Communicator, mpi_path: Communicator) -> Communicator:
    """Each sum path in turn: the default communicator's (node-shared where it applies), MPI's."""
    return comm if request.param == "node-shared" else mpi_path
