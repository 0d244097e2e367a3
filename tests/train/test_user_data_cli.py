"""The user's own model and data through the commands, as users run them: ``mpiexec -n 2
python -m mpi4py -m mpisolve train|compare|advise`` on a CIFAR-10 directory, an image
folder and a module of factories written here; TensorBoard scalars read back."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .userdata import MODULE, write_cifar10, write_image_folder, write_module

BIN = Path(sys.executable).parent


def mpisolve(command, *args, ranks=2, cwd=None):
    env = dict(os.environ, MPIEXEC_TIMEOUT="120", MPISOLVE_TIMEOUT="60")
    cmd = [str(BIN / "mpiexec"), "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "mpisolve", command, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=cwd)


def records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_trains_on_cifar10_from_disk_with_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cifar = write_cifar10(tmp_path / "data", per_batch=16, test=20)["folder"]
    log, board = tmp_path / "run.jsonl", tmp_path / "tb"
    args = ("--model", "cnn", "--dataset", f"cifar10:{cifar}", "--batch-size", "8", "--steps", "3")
    result = mpisolve("train", *args, "--log-every", "1", "--log", str(log), "--tensorboard", str(board))
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run.summary.json").read_text())
    assert summary["ranks"] == 2 and summary["steps"] == 3 and summary["workload"]["dataset"] == f"cifar10:{cifar}"
    assert summary["final_accuracy"] is not None  # evaluated on the 20 test images at the end
    written = records(log)
    assert [r["step"] for r in written] == [1, 2, 3] and all(r["global_samples"] == 16 for r in written)
    assert summary["epochs"] == pytest.approx(3 * 16 / 80)
    # TensorBoard (rank 0 alone): the records' numbers under their own names, read back by tensorboard.
    (events,) = [p for p in board.iterdir() if p.name.startswith("events.out.tfevents")]
    scalars = EventAccumulator(str(board))
    scalars.Reload()
    for key in ("loss", "train_accuracy", "samples_per_s", "epoch", "wall_s"):
        assert [(e.step, e.value) for e in scalars.Scalars(key)] == [
            (r["step"], pytest.approx(r[key], rel=1e-6)) for r in written
        ], key
    assert [(e.step, e.value) for e in scalars.Scalars("test_accuracy")] == [
        (3, pytest.approx(written[-1]["test_accuracy"], rel=1e-6))
    ]
    assert [e.value for e in scalars.Scalars("busy")] == [pytest.approx(sum(r["busy"]) / 2, rel=1e-6) for r in written]


def test_trains_on_an_image_folder(tmp_path):
    write_image_folder(tmp_path / "images", per_class=4, size=20)
    log = tmp_path / "run.jsonl"
    args = ("--model", "cnn", "--dataset", f"imagefolder:{tmp_path / 'images'}", "--image-size", "16")
    result = mpisolve("train", *args, "--batch-size", "3", "--steps", "2", "--log-every", "1", "--log", str(log))
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run.summary.json").read_text())
    assert summary["ranks"] == 2 and summary["steps"] == 2 and summary["workload"]["image_size"] == 16
    assert summary["final_accuracy"] is not None and summary["samples_by_rank"] == [6, 6]


def test_a_dataset_factory_trains_exactly_as_the_same_tensors(tmp_path):
    """``MODULE:FACTORY`` giving the digits split as Datasets: the same shards, batches and
    updates as ``--dataset digits``, so the same losses (same machine, same computation)."""
    write_module(tmp_path)
    runs = {}
    for name, dataset in (("tensors", "digits"), ("factory", f"{MODULE}:digits_data")):
        log = tmp_path / f"{name}.jsonl"
        args = ("--dataset", dataset, "--model", "mlp", "--steps", "4", "--log-every", "1", "--log", str(log))
        result = mpisolve("train", *args, cwd=tmp_path)  # the module is found in the current directory
        assert result.returncode == 0, result.stderr
        runs[name] = records(log)
    for a, b in zip(runs["tensors"], runs["factory"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6) and b["train_accuracy"] == a["train_accuracy"]


def test_compare_takes_the_user_model_and_data_from_a_toml_file(tmp_path):
    write_module(tmp_path)
    config = tmp_path / "run.toml"
    config.write_text(
        f'model = "{MODULE}:make_model"\ndataset = "{MODULE}:make_data"\nsteps = 2\nbatch_size = 4\n'
        f'solvers = "allreduce,local-sgd"\nout = "{tmp_path / "out"}"\ntensorboard = "{tmp_path / "tb"}"\n'
    )
    result = mpisolve("compare", "--config", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["workload"]["model"] == f"{MODULE}:make_model" and set(summary["solvers"]) == {
        "allreduce",
        "local-sgd",
    }
    for solver in ("allreduce", "local-sgd"):  # one TensorBoard run per solver
        assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb" / solver).iterdir())
    assert (tmp_path / "out" / "loss_vs_time.png").exists()


def test_advise_measures_the_user_model_on_the_user_data(tmp_path):
    write_module(tmp_path)
    args = ("--model", f"{MODULE}:make_model", "--dataset", f"{MODULE}:make_data", "--batch-size", "4")
    result = mpisolve("advise", *args, "--repeats", "2", "--warmup", "0", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    in_features, hidden, classes = 3 * 6 * 6, 16, 4  # make_model on make_data's 3x6x6 images in 4 classes
    assert figures["parameters"] == (in_features + 1) * hidden + (hidden + 1) * classes
    assert figures["model"] == f"{MODULE}:make_model" and figures["compute_s"] > 0 and math.isfinite(figures["ratio"])


@pytest.mark.parametrize(
    ("command", "args", "problem"),
    [
        ("train", ["--model", "nowhere.nets:make"], "--model nowhere.nets:make: cannot import nowhere.nets"),
        ("train", ["--dataset", f"{MODULE}:broken_data"], "the factory returned a list; expected (train, test)"),
        ("train", ["--dataset", "imagefolder:{tmp}/nowhere"], "imagefolder: {tmp}/nowhere is not a directory"),
        ("train", ["--dataset", "cifar10:{tmp}/cifar"], "{tmp}/cifar/cifar-10-batches-py/data_batch_2 is not a"),
        ("advise", ["--dataset", f"{MODULE}:raising_data"], "the factory raised RuntimeError: no data here"),
    ],
)
def test_bad_user_input_is_one_line_on_every_rank(tmp_path, command, args, problem):
    write_module(tmp_path)
    (write_cifar10(tmp_path / "cifar")["folder"] / "data_batch_2").write_bytes(b"truncated")
    result = mpisolve(command, *[a.format(tmp=tmp_path) for a in args], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[0] == lines[1], result.stderr  # one line from each rank, nothing else
    assert lines[0].startswith(f"mpisolve {command}: error: ") and problem.format(tmp=tmp_path) in lines[0]
