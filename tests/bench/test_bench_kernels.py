"""``python -m mpisolve bench kernels``: every kernel module timed against its reference."""

import json

from mpisolve.bench.kernels import KERNEL_MODULES
from mpisolve.cli import main


def test_bench_kernels_prints_cases_and_ratios(capsys):
    assert main(["bench", "kernels", "--numel", "300", "--repeats", "1", "--warmup", "1", "--kernels", "fused"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["cases"]) == {f"fused.{op} {n} tensors" for op in ("pack", "unpack") for n in (4, 200)}
    for case in result["cases"].values():
        assert case["kernel_s"] > 0 and case["reference_s"] > 0
        assert case["kernel_over_reference"] == case["kernel_s"] / case["reference_s"]


def test_bench_kernels_times_every_module(capsys):
    assert main(["bench", "kernels", "--numel", "8", "--repeats", "1", "--warmup", "0"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {name.split(".")[0] for name in result["cases"]} == set(KERNEL_MODULES)


def test_bench_kernels_refuses_empty_data(capsys):
    assert main(["bench", "kernels", "--numel", "0"]) == 2
    assert "--numel must be >= 1" in capsys.readouterr().err
