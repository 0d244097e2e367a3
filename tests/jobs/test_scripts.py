"""The job scripts without Slurm: syntax, GPU binding, launcher errors, the workstation script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

JOBS = Path(__file__).resolve().parents[2] / "jobs"
SCRIPTS = sorted(p for p in JOBS.iterdir() if p.suffix in (".sh", ".sbatch"))


def run(cmd: list[str], env: dict[str, str], timeout: float = 30) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MPI_LOCALRANKID", "OMPI_", "CUDA_"))}
    return subprocess.run(cmd, env={**clean, **env}, capture_output=True, text=True, timeout=timeout)


def test_every_script_parses():
    assert {p.name for p in SCRIPTS} >= {
        "single-node-cpu.sbatch",
        "multi-node-cpu.sbatch",
        "single-node-gpu.sbatch",
        "multi-node-gpu.sbatch",
        "launch.sh",
        "site.sh",
        "gpu-bind.sh",
        "workstation.sh",
    }
    for script in SCRIPTS:
        done = run(["bash", "-n", str(script)], env={})
        assert done.returncode == 0, f"{script.name}: {done.stderr}"


@pytest.mark.parametrize(
    ("env", "visible"),
    [
        ({"MPI_LOCALRANKID": "2", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, "6"),  # Hydra, within Slurm's GPUs
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "1"}, "1"),  # Open MPI, no list: the index itself
        ({"SLURM_LOCALID": "5", "CUDA_VISIBLE_DEVICES": "0,1"}, "1"),  # srun, more ranks than GPUs
        ({"MPI_LOCALRANKID": "3", "SLURM_LOCALID": "0"}, "3"),  # mpiexec in a batch script: not SLURM_LOCALID
    ],
)
def test_gpu_bind_gives_each_rank_its_gpu(env, visible):
    done = run([str(JOBS / "gpu-bind.sh"), "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"], env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == visible


def test_gpu_bind_without_a_local_rank_fails_clearly():
    done = run([str(JOBS / "gpu-bind.sh"), "true"], env={})
    assert done.returncode == 2
    assert "no node-local rank" in done.stderr


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ([], {"SLURM_NTASKS": "4"}, "no training options given"),
        (["--solver", "allreduce"], {}, "not inside a Slurm allocation"),
        (
            ["--solver", "allreduce"],
            {"SLURM_NTASKS": "4", "MPISOLVE_LAUNCHER": "aprun"},
            "must be srun, mpiexec or mpirun, not 'aprun'",
        ),
    ],
)
def test_launch_refuses_bad_use(args, env, message):
    done = run([str(JOBS / "launch.sh"), *args], env)
    assert done.returncode != 0
    assert message in done.stderr


def test_workstation_script_trains_on_every_rank(tmp_path):
    env = {
        "NP": "2",
        "PYTHON": sys.executable,
        "MPIEXEC": str(Path(sys.executable).with_name("mpiexec")),
        "MPIEXEC_TIMEOUT": "90",
    }
    log = tmp_path / "run.jsonl"
    done = run([str(JOBS / "workstation.sh"), "--model", "mlp", "--steps", "4", "--log", str(log)], env, timeout=120)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "run.summary.json").read_text())
    assert summary["ranks"] == 2 and summary["steps"] == 4 and len(summary["busy"]) == 2


def documented_command(script: Path) -> list[str]:
    """The training options of the script's first example (``#   sbatch jobs/NAME ...``), continuation lines joined."""
    lines = script.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"#   sbatch jobs/{script.name} "))
    text = ""
    for line in lines[start:]:
        text += line.lstrip("# ").rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            break
    return text.split()[2:]  # after "sbatch jobs/NAME"


@pytest.mark.parametrize("template", [p for p in SCRIPTS if p.suffix == ".sbatch"], ids=lambda p: p.name)
def test_each_template_documents_a_command_that_runs(template, tmp_path):
    """The example at the top of each template, its $CIFAR_DIR a CIFAR-10 directory in the real
    format: its settings are valid, its data set loads and its model fits the data."""
    import argparse

    from mpisolve.train.config import add_arguments, train_config
    from mpisolve.train.data import load_dataset
    from mpisolve.train.models import model_for
    from tests.train.userdata import write_cifar10

    args = documented_command(template)
    assert "$CIFAR_DIR" in " ".join(args), args  # the CIFAR example, documented in the header
    assert "CIFAR_DIR:" in template.read_text()
    cifar = write_cifar10(tmp_path)["folder"]
    args = [a.replace("$CIFAR_DIR", str(cifar)) for a in args]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = train_config(parser.parse_args(args), world_size=4)
    data = load_dataset(config.dataset, image_size=config.image_size)
    assert data.in_shape == (3, 32, 32) and len(data.train) == 40
    model_for(config.model, data, seed=0)
