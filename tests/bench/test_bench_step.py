"""``bench step`` and the benches' ``--device`` option (the GPU runs are marked gpu)."""

import argparse
import json

import pytest
import torch
from mpi4py import MPI

import mpisolve
from mpisolve.bench import bench_device, interleaved_medians
from mpisolve.cli import main
from mpisolve.comm.communicator import Communicator
from mpisolve.errors import CollectiveInputError


@pytest.mark.parametrize("solver", mpisolve.solver_names())  # async-msgd, async-measgd: their own momentum
def test_bench_step_times_every_solver_against_plain_pytorch(solver, capsys):
    argv = ["bench", "step", "--solver", solver, "--model", "mlp", "--batch", "4", "--repeats", "1", "--warmup", "1"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["solver"] == solver and result["device"] == "cpu" and result["ranks"] == 1
    assert result["solver_s"] > 0 and result["plain_s"] > 0
    assert result["solver_over_plain"] == result["solver_s"] / result["plain_s"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)
@pytest.mark.parametrize("solver", ["abs-sgd", "adasum", "allreduce", "easgd"])
@pytest.mark.parametrize("node_shm", ["on", "off"])
def test_bench_step_says_whether_the_solvers_sums_were_node_shared(solver, node_shm, capsys):
    argv = ["bench", "step", "--solver", solver, "--model", "mlp", "--batch", "4", "--repeats", "1", "--warmup", "0"]
    assert main([*argv, "--node-shm", node_shm]) == 0
    if MPI.COMM_WORLD.Get_rank() == 0:
        result = json.loads(capsys.readouterr().out)
        # easgd averages whole models through MPI: it has no node-shared path.
        assert result["node_shm"] is (node_shm == "on" and solver != "easgd")


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)
@pytest.mark.parametrize("solver", ["allreduce", "adasum"])
def test_bench_step_times_horovods_optimizer_beside_the_solver(solver, capsys):
    argv = ["bench", "step", "--solver", solver, "--horovod", "--model", "mlp", "--batch", "4", "--repeats", "1"]
    assert main([*argv, "--warmup", "0"]) == 0
    if MPI.COMM_WORLD.Get_rank() == 0:
        result = json.loads(capsys.readouterr().out)
        assert result["horovod_s"] > 0 and result["horovod_over_solver"] == result["horovod_s"] / result["solver_s"]


def test_bench_step_times_an_optimizer_that_writes_the_gradients(capsys):
    argv = ["bench", "step", "--model", "mlp", "--batch", "4", "--repeats", "1", "--warmup", "1"]
    assert main([*argv, "--optimizer", "nesterov-foreach"]) == 0
    assert json.loads(capsys.readouterr().out)["optimizer"] == "nesterov-foreach"
    assert main([*argv, "--optimizer", "nesterov-foreach", "--solver", "async-msgd"]) == 2
    assert "async-msgd applies its own momentum" in capsys.readouterr().err


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


def test_interleaved_medians_time_only_the_functions(monkeypatch):
    # Whether to wait for the GPU is is_initialized() (nanoseconds), asked after each call,
    # warm-up or not; never is_available() (microseconds: a 4 KiB allreduce's order).
    comm, asked, synced, calls = Communicator(MPI.COMM_SELF), [], [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(1) or True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synced.append(calls[-1]))
    timings = interleaved_medians({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, comm, 5, 0)
    assert calls == ["a", "b"] * 5 and set(timings) == {"a", "b"}
    assert synced == calls and asked == []
