"""A short soak (``bench soak``): every asynchronous solver frees all its MPI windows."""

import argparse

import pytest
import torch

import mpisolve
from mpisolve.bench.soak import open_windows, run
from mpisolve.comm.windows import SharedVector
from mpisolve.solvers.base import solver_class


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(4)
def test_short_soak_frees_every_window():
    comm = mpisolve.init()
    held = open_windows()  # kept by tests run before in this process (mpisolve.allreduce's windows)
    vector = SharedVector(comm, 100, torch.float32)
    assert open_windows() == held + 1  # the count sees a live window
    vector.close()
    assert open_windows() == held
    result = run(argparse.Namespace(solvers="async", steps=12, warmup_steps=4, batch_size=16, model="cnn"), comm)
    expected = [n for n in mpisolve.solver_names() if not solver_class(n).lockstep]
    assert sorted(result["solvers"]) == sorted(expected) and len(expected) >= 6
    for name, figures in result["solvers"].items():
        assert figures["open_windows"] == 0, name
        assert len(figures["rss_end_mb"]) == comm.size and all(r > 0 for r in figures["rss_end_mb"])
