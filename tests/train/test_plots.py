"""``mpisolve plot``: PNGs from JSON Lines logs, in one process."""

import json

from mpisolve.cli import main
from mpisolve.train.metrics import read_records

PNG = b"\x89PNG\r\n\x1a\n"


def write_log(path, accuracies):
    with open(path, "w") as f:
        for i, acc in enumerate(accuracies):
            f.write(
                json.dumps(
                    {"step": 10 * (i + 1), "epoch": 0.5 * (i + 1), "wall_s": 1.5 * (i + 1), "test_accuracy": acc}
                )
                + "\n"
            )
        f.write('{"step": 99, "ep')  # a torn last line, as a crash leaves it


def test_plot_command_draws_both_plots(tmp_path, capsys):
    write_log(tmp_path / "allreduce.jsonl", [0.5, None, 0.8])
    write_log(tmp_path / "adasum.jsonl", [0.6, 0.7, 0.9])
    assert len(read_records(tmp_path / "adasum.jsonl")) == 3
    out = tmp_path / "plots"
    assert main(["plot", str(tmp_path / "allreduce.jsonl"), str(tmp_path / "adasum.jsonl"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(printed) == sorted(str(out / n) for n in ("accuracy_vs_time.png", "accuracy_vs_epochs.png"))
    for name in printed:
        with open(name, "rb") as f:
            assert f.read(8) == PNG


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
