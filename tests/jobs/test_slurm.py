"""The single-node sbatch templates on a real Slurm: ``mpisolve train`` submitted with
``sbatch --wait``; the CPU template launched by srun (PMI2) and by mpiexec inside the
allocation on 4 ranks, the GPU template by srun on 2 ranks bound by gpu-bind.sh to the
node's 2 allocated (stand-in) GPUs. The srun job reads CIFAR-10 from a directory in the
real format (``--dataset cifar10:$CIFAR_DIR``, as the templates' headers show)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.train.userdata import write_cifar10

from .slurm_cluster import REPO, JobResult, SlurmCluster

CPU_TEMPLATE = REPO / "jobs" / "single-node-cpu.sbatch"
GPU_TEMPLATE = REPO / "jobs" / "single-node-gpu.sbatch"
TRAIN = ("--solver", "allreduce", "--steps", "12", "--log-every", "4")
MLP_ON_DIGITS = ("--model", "mlp", "--dataset", "digits")
#: name -> (template, ranks, sbatch options, environment, model and data set; {cifar}: a CIFAR-10 directory)
JOBS = {
    # The CNN: fewer parameters on CIFAR's 3x32x32 images than the MLP, so no slower than the MLP on digits.
    "srun": (CPU_TEMPLATE, 4, (), {"MPISOLVE_LAUNCHER": "srun"}, ("--model", "cnn", "--dataset", "cifar10:{cifar}")),
    "mpiexec": (CPU_TEMPLATE, 4, (), {"MPISOLVE_LAUNCHER": "mpiexec"}, MLP_ON_DIGITS),
    # The template asks for 4 GPUs and 8 cores per task; 2 of each fit this machine.
    "gpu": (GPU_TEMPLATE, 2, ("--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1"), {}, MLP_ON_DIGITS),
}
LAUNCHED = {"srun": "srun --mpi=pmi2", "mpiexec": "mpiexec -n 4", "gpu": "srun --mpi=pmi2 --cpu-bind=cores"}

# Every step inside has its own, shorter timeout, so the cluster is always stopped in
# teardown rather than left behind by pytest-timeout ending the process.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def jobs(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[JobResult, Path]]:
    """This module's jobs and their logs, submitted together: ``sbatch --wait`` checks on its
    job 2, 10 and 42 s after submitting it, so jobs waited for in turn would each cost a wait."""
    runs = tmp_path_factory.mktemp("runs")
    cifar = write_cifar10(tmp_path_factory.mktemp("data"), per_batch=8, test=10)["folder"]
    logs = {name: runs / f"{name}.jsonl" for name in JOBS}
    submitted = {
        name: slurm.submit(
            template, *TRAIN, *[a.format(cifar=cifar) for a in data], "--log", str(logs[name]), env=env, sbatch=sbatch
        )
        for name, (template, _, sbatch, env, data) in JOBS.items()
    }
    submitted["no options"] = slurm.submit(CPU_TEMPLATE, env={})
    return {name: (job.result(), logs.get(name, runs)) for name, job in submitted.items()}


@pytest.mark.parametrize("name", JOBS)
def test_single_node_template_trains_on_every_rank(jobs, name: str) -> None:
    job, log = jobs[name]
    ranks = JOBS[name][1]
    assert job.returncode == 0, job.output
    assert f"mpisolve job: {LAUNCHED[name]}" in job.output, job.output
    summary = json.loads(log.with_name(f"{name}.summary.json").read_text())
    assert summary["ranks"] == ranks and summary["steps"] == 12 and len(summary["busy"]) == ranks, summary
    assert summary["workload"]["dataset"].split(":")[0] == JOBS[name][4][3].split(":")[0], summary
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r["step"] for r in records]  # every 4 updates, and where an evaluation fell
    assert steps[-1] == 12 and {4, 8} <= set(steps), records
    assert all(len(r["busy"]) == ranks and r["global_samples"] == ranks * 32 for r in records), records


def test_gpu_template_binds_each_rank_to_its_gpu(jobs) -> None:
    job, _ = jobs["gpu"]
    assert "jobs/gpu-bind.sh" in job.output.split("mpisolve job:")[1].splitlines()[0], job.output


def test_template_without_training_options_fails_clearly(jobs) -> None:
    job, _ = jobs["no options"]
    assert job.returncode == 2, job.output
    assert "no training options given" in job.output
