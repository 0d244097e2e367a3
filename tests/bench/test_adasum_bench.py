"""``bench adasum --compare-paths``: the node path and MPI's message path timed in one run."""

import argparse

import pytest

from mpisolve.bench import adasum
from mpisolve.comm.communicator import Communicator


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)
def test_compare_paths_times_both_paths_and_says_which_was_taken():
    args = argparse.Namespace(
        model=None, numel=1000, tensors=3, bucket_mb=25.0, device="cpu", repeats=1, warmup=0, compare_paths=True
    )
    result = adasum.run(args, Communicator())
    assert result["node_path"] is True  # two ranks on this machine share its memory
    for key in ("adasum_mpi_path_s", "adasum_buckets_mpi_path_s", "node_over_mpi_path", "node_over_mpi_path_buckets"):
        assert result[key] > 0
