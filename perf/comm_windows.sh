#!/usr/bin/env bash
# Performance model (write-up: docs/studies/performance-model.md): what one window exchange costs (bench windows) at 2, 4 and 8
# ranks and three vector sizes, the window solvers' calibration.
# -> perf/results/comm_windows/ (windows_n<N>.csv, table.md)
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python}" perf/comm_windows.py --ranks 2 4 8
