"""``python -m mpisolve model``: its table, and bad input exiting 2 with one line."""

import csv
import subprocess
import sys

import pytest


def model(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mpisolve", "model", *args], capture_output=True, text=True, timeout=60)


def test_projects_every_rank_count(tmp_path):
    out = tmp_path / "p.csv"
    done = model("--solver", "allreduce,ea-wild", "--model", "resnet18", "--ranks", "1,16,1024", "--csv", str(out))
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(out.open()))
    assert [(r["solver"], int(r["ranks"])) for r in rows] == [(s, p) for s in ("allreduce", "ea-wild") for p in (1, 16, 1024)]
    first = rows[0]
    assert float(first["efficiency"]) == pytest.approx(1.0) and float(first["samples_per_s"]) == pytest.approx(6000)
    allreduce = [float(r["efficiency"]) for r in rows if r["solver"] == "allreduce"]
    assert allreduce == sorted(allreduce, reverse=True)  # efficiency falls with ranks
    assert "allreduce" in done.stdout and "1024" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ranks", "0,4"], "--ranks must be whole numbers >= 1"),
        (["--ranks", "four"], "--ranks must be whole numbers separated by commas"),
        (["--solver", "sgd"], "no performance model for solver 'sgd'"),
        (["--model", "vgg"], "unknown model 'vgg'"),
        (["--model", "mlp"], "give --throughput or --step-time for model 'mlp'"),
        (["--network", "ib9"], "unknown network 'ib9'"),
        (["--solver", "allreduce", "--set", "tau=3"], "no chosen solver's model takes 'tau'"),
        (["--solver", "easgd", "--set", "tau=x"], "option 'tau' of solver 'easgd' must be int"),
        (["--calibration", "/nonexistent.csv"], "cannot read sweep CSV /nonexistent.csv"),
        (["--overlap", "2"], "--overlap must be in [0, 1]"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, message):
    done = model(*args)
    assert done.returncode == 2
    assert message in done.stderr and done.stderr.count("\n") == 1, done.stderr
