#!/usr/bin/env bash
# README "Scaling study": every registered solver, MLP and CNN on digits, 1, 2, 4, 8 ranks,
# weak scaling (32 samples per rank per step), throughput, efficiency, busy/comm/idle.
# -> perf/results/scaling/ (scaling.csv, scaling_mlp.png, scaling_cnn.png, one directory per run)
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python}" perf/scaling.py --models mlp,cnn --ranks 1 2 4 8
