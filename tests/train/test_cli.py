"""The train command as users run it: under ``mpiexec -n 2 python -m mpi4py -m mpisolve``."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
RECORD = {
    "step",
    "epoch",
    "wall_s",
    "loss",
    "train_accuracy",
    "test_accuracy",
    "test_loss",
    "global_samples",
    "samples_per_s",
    "busy",
    "comm",
    "idle",
    "skipped_steps",
}
SUMMARY = {
    "solver",
    "options",
    "ranks",
    "mpi_library_version",
    "versions",
    "git_commit",
    "time_to_target_s",
    "epochs_to_target",
    "final_accuracy",
}


def mpisolve(*args, ranks=2, cwd=None):
    env = dict(os.environ, MPIEXEC_TIMEOUT="120", MPISOLVE_TIMEOUT="60")
    cmd = [str(BIN / "mpiexec"), "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "mpisolve", "train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=cwd)


@pytest.mark.parametrize(
    "args, line",
    [
        (["--lr", "-1"], "mpisolve train: error: --lr must be > 0, got -1.0"),
        (["--lr", "abc"], "mpisolve train: error: argument --lr: invalid float value: 'abc'"),
        (
            ["--hetero", "1,2,4"],
            "mpisolve train: error: --hetero gives 3 factors for 2 ranks (give one per rank, or a preset)",
        ),
        (
            ["--model", "vgg"],
            "mpisolve train: error: unknown model 'vgg' (give mlp, cnn, resnet18, torchvision:NAME or MODULE:FACTORY)",
        ),
        (["--batch-size", "0"], "mpisolve train: error: --batch-size must be >= 1, got 0"),
        (
            ["--set", "tau=2"],
            "mpisolve train: error: solver 'allreduce' does not take option 'tau' "
            "(it takes: broadcast_buffers, bucket_mb, nonfinite)",
        ),
    ],
)
def test_bad_values_exit_2_with_one_line_on_every_rank(args, line):
    result = mpisolve(*args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [line, line]  # one line from each rank, nothing else
    assert result.stdout == ""


def test_train_writes_records_and_summary(tmp_path):
    log = tmp_path / "run.jsonl"
    result = mpisolve(
        "--steps",
        "6",
        "--log-every",
        "2",
        "--eval-every",
        "0.3",
        "--target-accuracy",
        "0.05",
        "--hetero",
        "1,2",
        "--log",
        str(log),
    )
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6] and all(set(r) == RECORD for r in records)
    assert [r["test_accuracy"] is not None for r in records] == [False, False, True]  # 0.3 epochs: 431 samples
    assert all(
        len(r["busy"]) == 2 and abs(r["busy"][i] + r["comm"][i] + r["idle"][i] - 1) < 1e-6
        for r in records
        for i in range(2)
    )
    summary = json.loads((tmp_path / "run.summary.json").read_text())
    assert SUMMARY <= set(summary) and summary["ranks"] == 2 and summary["steps"] == 6
    assert summary["time_to_target_s"] is not None and summary["final_accuracy"] == records[-1]["test_accuracy"]
    assert summary["epochs_to_target"] == records[-1]["epoch"]  # first evaluation: the last record
    assert json.loads(result.stdout) == summary  # rank 0 prints it once
    assert "allreduce" in result.stderr  # progress lines from rank 0 (not a terminal: plain lines)
