"""The advise command as users run it: under ``mpiexec -n 2 python -m mpi4py -m mpisolve``."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from mpisolve.advise import STUDIES, boundary, studies

BIN = Path(sys.executable).parent
QUICK = ["--model", "mlp", "--batch-size", "2", "--repeats", "3", "--warmup", "1"]


def advise(*args, ranks=2):
    env = dict(os.environ, MPIEXEC_TIMEOUT="120", MPISOLVE_TIMEOUT="60")
    cmd = [str(BIN / "mpiexec"), "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "mpisolve", "advise", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)


def test_recommendation_is_the_nearest_studys_winner_and_names_its_figures():
    result = advise(*QUICK)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    compute_ms = float(re.search(r"computation: ([0-9.]+) ms", text).group(1))
    allreduce_ms = float(re.search(r"communication: ([0-9.]+) ms", text).group(1))
    ratio = float(re.search(r"computation/communication ratio: ([0-9.]+)", text).group(1))
    # the ratio of the printed figures, each rounded to 0.01 ms (the ratio to 0.001)
    assert (compute_ms - 0.005) / (allreduce_ms + 0.005) - 0.001 <= ratio
    assert ratio <= (compute_ms + 0.005) / (allreduce_ms - 0.005) + 0.001
    assert f"ratio < {boundary():.3g} -> ea-wild, else allreduce" in text
    low, high = sorted(studies()["points"], key=lambda point: point["ratio"])
    point = low if ratio < boundary() else high
    assert re.search(r"^recommendation: (\S+)", text, re.M).group(1) == point["winner"]
    # the measured figure it rests on: the study's workload, ratio and both solvers' times to target
    measured = re.search(r"^measured: (.*)$", text, re.M).group(1)
    times = point["median_time_to_target_s"]
    assert point["workload"] in measured and f"{times['allreduce']:.2f} s" in measured
    assert f"{times['ea-wild']:.2f} s" in measured
    # the model figure: both solvers' modelled iterations
    assert re.search(r"^model: .*allreduce [0-9.]+ ms .*ea-wild [0-9.]+ ms", text, re.M)
    assert text.count("recommendation:") == 1  # rank 0 alone prints


def test_the_study_picks_each_side_and_the_threshold_overrides():
    """A communication-bound step (2 x 0.01 ms) is the MLP's side: ea-wild; a compute-bound one
    (2 x 50 ms) falls on the side its measured ratio gives (the CNN's, allreduce, unless the
    machine's allreduce is slowed past 100 ms / the boundary); --threshold moves the boundary."""
    for device_ms, threshold, expected in (
        ("0.01", [], "ea-wild"),
        ("50", [], None),
        ("50", ["0"], "allreduce"),
        ("50", ["1e9"], "ea-wild"),
    ):
        extra = ["--threshold", *threshold] if threshold else []
        result = advise(*QUICK, "--repeats", "1", "--json", "--device-ms", device_ms, *extra)
        assert result.returncode == 0, result.stderr
        figures = json.loads(result.stdout)
        assert figures["ranks"] == 2 and figures["allreduce_s"] > 0 and figures["latency_s"] > 0
        assert figures["compute_s"] == 2 * float(device_ms) * 1e-3
        assert figures["ratio"] == figures["compute_s"] / figures["allreduce_s"]
        if expected is None:  # the measured ratio's side of the studies' boundary
            expected = "ea-wild" if figures["ratio"] < boundary() else "allreduce"
        assert figures["recommendation"] == expected, figures
        assert figures["measured"]["winner"] == expected
        modelled = figures["modelled_iteration_s"]
        assert modelled["allreduce"] >= figures["compute_s"] and modelled["ea-wild"] >= figures["compute_s"]


def test_the_studies_figures_are_what_the_results_say():
    """mpisolve/studies.json is perf/advise_studies.py's reading of perf/results/easgd/results.json."""
    perf = Path(__file__).resolve().parents[1] / "perf"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, advise_studies as a; print(json.dumps(a.evidence(json.loads(a.SOURCE.read_text()))))",
        ],
        capture_output=True,
        text=True,
        cwd=perf,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == json.loads(STUDIES.read_text())
    low, high = sorted(studies()["points"], key=lambda point: point["ratio"])
    assert (low["winner"], high["winner"]) == ("ea-wild", "allreduce")  # the study's finding
    assert low["ratio"] < boundary() < high["ratio"]


def test_bad_input_exits_2_with_one_line_on_every_rank():
    result = advise("--batch-size", "0")
    assert result.returncode == 2, result.stderr
    line = "mpisolve advise: error: --batch-size must be >= 1, got 0"
    assert result.stderr.splitlines() == [line, line] and result.stdout == ""
