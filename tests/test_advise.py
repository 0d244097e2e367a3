"""The advise command as users run it: under ``mpiexec -n 2 python -m mpi4py -m mpisolve``."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from mpisolve.advise import EA_WILD_BELOW

BIN = Path(sys.executable).parent
QUICK = ["--model", "mlp", "--batch-size", "2", "--repeats", "3", "--warmup", "1"]


def advise(*args, ranks=2):
    env = dict(os.environ, MPIEXEC_TIMEOUT="120", MPISOLVE_TIMEOUT="60")
    cmd = [str(BIN / "mpiexec"), "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "mpisolve", "advise", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)


def test_recommendation_follows_the_printed_ratio_and_the_documented_rule():
    result = advise(*QUICK)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    compute_ms = float(re.search(r"computation: ([0-9.]+) ms", text).group(1))
    allreduce_ms = float(re.search(r"communication: ([0-9.]+) ms", text).group(1))
    ratio = float(re.search(r"computation/communication ratio: ([0-9.]+)", text).group(1))
    # the ratio of the printed figures, each rounded to 0.01 ms (the ratio to 0.001)
    assert (compute_ms - 0.005) / (allreduce_ms + 0.005) - 0.001 <= ratio
    assert ratio <= (compute_ms + 0.005) / (allreduce_ms - 0.005) + 0.001
    assert f"rule: ratio < {EA_WILD_BELOW:g} -> ea-wild, else allreduce" in text
    expected = "ea-wild" if ratio < EA_WILD_BELOW else "allreduce"
    assert re.search(r"^recommendation: (\S+)", text, re.M).group(1) == expected
    assert text.count("recommendation:") == 1  # rank 0 alone prints


def test_threshold_forces_either_side():
    for threshold, expected, device in (("0", "allreduce", []), ("1e9", "ea-wild", ["--device-ms", "5"])):
        result = advise(*QUICK, "--repeats", "1", "--json", "--threshold", threshold, *device)
        assert result.returncode == 0, result.stderr
        figures = json.loads(result.stdout)
        assert figures["ranks"] == 2 and figures["compute_s"] > 0 and figures["allreduce_s"] > 0
        if device:  # an emulated device's step: batch 2 x 5 ms
            assert figures["compute_s"] == 2 * 5e-3 and figures["device_ms"] == 5
        assert figures["ratio"] == figures["compute_s"] / figures["allreduce_s"]
        assert figures["recommendation"] == expected, figures


def test_bad_input_exits_2_with_one_line_on_every_rank():
    result = advise("--batch-size", "0")
    assert result.returncode == 2, result.stderr
    line = "mpisolve advise: error: --batch-size must be >= 1, got 0"
    assert result.stderr.splitlines() == [line, line] and result.stdout == ""
