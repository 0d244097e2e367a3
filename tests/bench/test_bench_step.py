"""``bench step`` and the benches' ``--device`` option (the GPU runs are marked gpu)."""

import argparse
import json

import pytest
import torch
from mpi4py import MPI

from mpisolve.bench import bench_device
from mpisolve.cli import main
from mpisolve.comm.communicator import Communicator
from mpisolve.options import CollectiveInputError


@pytest.mark.parametrize("solver", ["allreduce", "async-msgd", "kfac"])  # async-msgd: its own momentum
def test_bench_step_times_every_solver_against_plain_pytorch(solver, capsys):
    argv = ["bench", "step", "--solver", solver, "--model", "mlp", "--batch", "4", "--repeats", "1", "--warmup", "1"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["solver"] == solver and result["device"] == "cpu" and result["ranks"] == 1
    assert result["solver_s"] > 0 and result["plain_s"] > 0
    assert result["solver_over_plain"] == result["solver_s"] / result["plain_s"]


def test_bench_step_refuses_an_unknown_solver(capsys):
    assert main(["bench", "step", "--model", "mlp", "--solver", "nope"]) == 2
    assert "--solver must be one of" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_device_cuda_without_a_gpu_is_named_on_every_rank():
    # main() would report it and finalize MPI (every rank failed alike), ending this process's MPI.
    with pytest.raises(CollectiveInputError, match="--device cuda needs a CUDA device"):
        bench_device(argparse.Namespace(device="cuda"), Communicator(MPI.COMM_SELF))
    assert bench_device(argparse.Namespace(device="cpu"), Communicator(MPI.COMM_SELF)) == torch.device("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "argv",
    [
        ["step", "--model", "mlp", "--batch", "8"],
        ["allreduce", "--numel", "100000", "--tensors", "7", "--no-gloo"],
        ["adasum", "--numel", "100000", "--tensors", "7"],
        ["kernels", "--numel", "4096"],
        ["kfac", "--model", "mlp", "--variants", "d-kfac"],
    ],
    ids=lambda argv: argv[0],
)
def test_benches_run_on_a_gpu(argv, capsys):
    assert main(["bench", *argv, "--device", "cuda", "--repeats", "2", "--warmup", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["device"].startswith("cuda")
