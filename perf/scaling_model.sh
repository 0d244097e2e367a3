#!/usr/bin/env bash
# Performance model (write-up: docs/studies/performance-model.md): calibrated on perf/results/model_calibration, validated
# against perf/results/scaling (so it runs after both: name order), projected to 16-1,024 GPUs.
# -> perf/results/scaling_model/ (calibration.csv, sharing.json, validation.csv/.md/.png, projection_*.csv, projection.png)
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python}" perf/scaling_model.py
