"""``mpisolve plot``: PNGs from JSON Lines logs, in one process."""

import json

import pytest

from mpisolve.cli import main
from mpisolve.train.metrics import read_records
from mpisolve.train.plots import figures

PNG = b"\x89PNG\r\n\x1a\n"


def write_log(path, accuracies):
    with open(path, "w") as f:
        for i, acc in enumerate(accuracies):
            record = {
                "step": 10 * (i + 1),
                "epoch": 0.5 * (i + 1),
                "wall_s": 1.5 * (i + 1),
                "loss": 2.0 / (i + 1),
                "samples_per_s": 100.0 + i,
                "test_accuracy": acc,
            }
            f.write(json.dumps(record) + "\n")
        f.write('{"step": 99, "ep')  # a torn last line, as a crash leaves it


def test_plot_command_draws_every_plot(tmp_path, capsys):
    write_log(tmp_path / "allreduce.jsonl", [0.5, None, 0.8])
    write_log(tmp_path / "adasum.jsonl", [0.6, 0.7, 0.9])
    assert len(read_records(tmp_path / "adasum.jsonl")) == 3
    out = tmp_path / "plots"
    assert main(["plot", str(tmp_path / "allreduce.jsonl"), str(tmp_path / "adasum.jsonl"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    names = ("accuracy_vs_time", "accuracy_vs_epochs", "loss_vs_time", "loss_vs_epochs", "samples_per_s_vs_time")
    assert sorted(printed) == sorted(str(out / f"{n}.png") for n in names)
    for name in printed:
        with open(name, "rb") as f:
            assert f.read(8) == PNG


def test_each_plot_draws_its_field_of_every_run(tmp_path):
    """The lines drawn are the records' own values (read back from matplotlib's figure)."""
    import matplotlib.pyplot as plt

    write_log(tmp_path / "run.jsonl", [0.5, None, 0.8])
    runs = {"run": read_records(tmp_path / "run.jsonl")}
    drawn = figures(runs)
    expected = {
        "accuracy_vs_time.png": [(1.5, 0.5), (4.5, 0.8)],  # no point where the accuracy is null
        "accuracy_vs_epochs.png": [(0.5, 0.5), (1.5, 0.8)],
        "loss_vs_time.png": [(1.5, 2.0), (3.0, 1.0), (4.5, 2.0 / 3)],
        "loss_vs_epochs.png": [(0.5, 2.0), (1.0, 1.0), (1.5, 2.0 / 3)],
        "samples_per_s_vs_time.png": [(1.5, 100.0), (3.0, 101.0), (4.5, 102.0)],
    }
    assert set(drawn) == set(expected)
    for name, points in expected.items():
        (line,) = drawn[name].axes[0].get_lines()
        assert line.get_label() == "run"
        assert [tuple(p) for p in line.get_xydata().tolist()] == [pytest.approx(p) for p in points], name
        plt.close(drawn[name])


def test_missing_log_is_one_line_and_status_2(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nope.jsonl")]) == 2
    assert capsys.readouterr().err.strip().startswith("mpisolve plot: error: cannot read the log")


def test_plot_runs_where_mpi_cannot_start(tmp_path):
    """On a login node MPI may not initialise: plot must not import mpi4py at all."""
    import subprocess
    import sys

    write_log(tmp_path / "run.jsonl", [0.5, 0.9])
    blocker = (
        "import sys; sys.modules['mpi4py'] = None; import runpy; sys.argv = ['mpisolve'] + sys.argv[1:]; "
        "runpy.run_module('mpisolve', run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", blocker, "plot", str(tmp_path / "run.jsonl"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "accuracy_vs_time.png").exists()
