"""``bench step --ddp`` and ``bench allreduce --compare-paths`` on real ranks: node-shared
buckets and MPI's path timed in one run, each named in the result."""

import argparse

import pytest

from mpisolve import bench
from mpisolve.bench import allreduce, step
from mpisolve.comm.communicator import Communicator


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args([*argv, "--repeats", "1", "--warmup", "0"])


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)
@pytest.mark.parametrize("node_shm", ["on", "off"])
def test_bench_step_against_ddp_says_which_path_it_timed(node_shm):
    comm = Communicator()
    result = step.run(bench_args("step", "--model", "mlp", "--batch", "4", "--ddp", "--node-shm", node_shm), comm)
    assert result["node_shm"] is (node_shm == "on") and result["nodes"] == 1 and result["ranks"] == comm.size
    assert result["solver_s"] > 0 and result["plain_s"] > 0 and result["ddp_gloo_s"] > 0
    assert result["solver_over_ddp"] == result["solver_s"] / result["ddp_gloo_s"]
    assert result["plain_over_ddp"] == result["plain_s"] / result["ddp_gloo_s"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)
def test_bench_allreduce_compares_the_node_shared_buckets_with_mpis_path():
    argv = ("allreduce", "--numel", "100000", "--tensors", "3", "--no-gloo", "--compare-paths")
    result = allreduce.run(bench_args(*argv), Communicator())
    assert result["node_shm"] is True and result["ranks_per_node"] == result["ranks"]
    assert result["mpisolve_s"] > 0 and result["mpisolve_mpi_path_s"] > 0
    assert result["mpi_path_over_mpi_contiguous"] == result["mpisolve_mpi_path_s"] / result["mpi_contiguous_s"]
