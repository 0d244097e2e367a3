"""Who moves MPI's operations along: the choices checked, and "auto" a thread only where it has a core to itself."""

import os

import pytest
from mpi4py import MPI

from mpisolve.comm.communicator import Communicator
from mpisolve.comm.progress import check_progress, resolve_progress
from mpisolve.errors import OptionError


def test_progress_modes_are_checked(monkeypatch):
    with pytest.raises(OptionError, match="progress must be one of"):
        check_progress("fast")
    monkeypatch.delenv("MPICH_ASYNC_PROGRESS", raising=False)
    with pytest.raises(OptionError, match="MPICH_ASYNC_PROGRESS=1"):
        check_progress("mpich")
    with pytest.raises(OptionError, match="MPICH_ASYNC_PROGRESS=1"):
        resolve_progress("mpich", Communicator())
    check_progress("thread")
    check_progress("auto")


def communicator_on(cpus: set[int]) -> Communicator:
    """A one-rank communicator made while this process may run on ``cpus`` only."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        return Communicator(MPI.COMM_SELF)
    finally:
        os.sched_setaffinity(0, allowed)


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to bind to"
)
def test_auto_runs_the_thread_with_two_cores_a_rank_and_not_with_one():
    first, second = sorted(os.sched_getaffinity(0))[:2]
    bound = communicator_on({first})
    two = communicator_on({first, second})
    assert bound.cores_per_rank == 1 and two.cores_per_rank == 2
    assert resolve_progress("auto", bound) == "none"
    assert resolve_progress("auto", two) == "thread"
    for given in ("thread", "none"):  # a choice made is kept
        assert resolve_progress(given, bound) == given and resolve_progress(given, two) == given
