"""The single-node sbatch templates on a real Slurm: submitted with ``sbatch --wait``,
launched by srun (PMI2) and by mpiexec inside the allocation, on all 4 ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_cluster import REPO, SlurmCluster

TEMPLATE = REPO / "jobs" / "single-node-cpu.sbatch"
STANDIN = Path(__file__).with_name("standin.py")

# Every step inside has its own, shorter timeout, so the cluster is always stopped in
# teardown rather than left behind by pytest-timeout ending the process.
pytestmark = pytest.mark.timeout(900)


@pytest.mark.parametrize("launcher", ["srun", "mpiexec"])
def test_single_node_template_runs_every_rank(slurm: SlurmCluster, launcher: str, tmp_path: Path) -> None:
    out = tmp_path / "ranks"
    job = slurm.sbatch(TEMPLATE, "--out", str(out), env={"MPISOLVE_LAUNCHER": launcher, "MPISOLVE_RUN": str(STANDIN)})
    assert job.returncode == 0, job.output
    launched = "srun --mpi=pmi2" if launcher == "srun" else "mpiexec -n 4"
    assert f"mpisolve job: {launched}" in job.output
    records = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    assert [r["rank"] for r in records] == [0, 1, 2, 3], job.output
    assert all(r["size"] == 4 and r["rank_sum"] == 6 for r in records), records


def test_template_without_training_options_fails_clearly(slurm: SlurmCluster) -> None:
    job = slurm.sbatch(TEMPLATE, env={})
    assert job.returncode == 2
    assert "no training options given" in job.output
