#!/usr/bin/env bash
# The performance model's calibration on this machine (write-up: docs/studies/performance-model.md): bench sweep and
# bench windows at 2, 4, 8 ranks; the study workloads' steps with 1, 2, 4, 8 ranks computing at once; a synthetic
# workload's allreduce, async-sgd and hogwild-sgd runs. Runs before perf/scaling_model.sh (name order).
# -> perf/results/model_calibration/ (sweep_n*.csv, windows_n*.csv, compute.csv, sync_*/scaling.csv, machine.json)
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python}" perf/model_calibration.py
