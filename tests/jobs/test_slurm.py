"""The single-node sbatch template on a real Slurm: submitted with ``sbatch --wait``,
launched by srun (PMI2) and by mpiexec inside the allocation, on all 4 ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from slurm_cluster import REPO, JobResult, SlurmCluster

TEMPLATE = REPO / "jobs" / "single-node-cpu.sbatch"
STANDIN = Path(__file__).with_name("standin.py")
LAUNCHERS = ("srun", "mpiexec")

# Every step inside has its own, shorter timeout, so the cluster is always stopped in
# teardown rather than left behind by pytest-timeout ending the process.
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def jobs(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[JobResult, Path]]:
    """This module's jobs, submitted together: ``sbatch --wait`` checks on its job 2, 10 and
    42 s after submitting it, so jobs waited for one after the other would each cost a wait."""
    runs = tmp_path_factory.mktemp("runs")
    submitted = {
        launcher: slurm.submit(TEMPLATE, "--out", str(runs / launcher), env={"MPISOLVE_LAUNCHER": launcher, "MPISOLVE_RUN": str(STANDIN)})
        for launcher in LAUNCHERS
    }
    submitted["no options"] = slurm.submit(TEMPLATE, env={})
    return {name: (job.result(), runs / name) for name, job in submitted.items()}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_single_node_template_runs_every_rank(jobs, launcher: str) -> None:
    job, out = jobs[launcher]
    assert job.returncode == 0, job.output
    launched = "srun --mpi=pmi2" if launcher == "srun" else "mpiexec -n 4"
    assert f"mpisolve job: {launched}" in job.output
    records = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    assert [r["rank"] for r in records] == [0, 1, 2, 3], job.output
    assert all(r["size"] == 4 and r["rank_sum"] == 6 for r in records), records


def test_template_without_training_options_fails_clearly(jobs) -> None:
    job, _ = jobs["no options"]
    assert job.returncode == 2, job.output
    assert "no training options given" in job.output
