#!/usr/bin/env bash
# The performance model against published tables (write-up: docs/studies/performance-model.md): Horovod's 512 GPUs,
# Goyal et al.'s 256, SPD-KFAC's 64, from the hardware and workloads they state. No measurement.
# -> perf/results/published/ (table.md, results.json)
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python}" perf/published.py
