#!/usr/bin/env bash
# Communication sweep (write-up: docs/studies/comm-sweep.md): allreduce latency and bus bandwidth, 4 B to 64 MiB, for
# MPI_Allreduce and mpisolve's sum, average, bucketed and adasum, at 2, 4 and 8 ranks.
# -> perf/results/comm_sweep/ (comm_sweep_n<N>.csv, .json, comm_sweep.png)
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python}" perf/comm_sweep.py --ranks 2 4 8
