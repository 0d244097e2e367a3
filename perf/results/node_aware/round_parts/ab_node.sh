#!/usr/bin/env bash
# perf/bucket_round_parts.py on one node with node-shared sums (the default), A = $BEFORE (a git archive of it in
# $BASE, run from that copy so that its mpisolve is imported) against B = main's checkout, alternating, three rounds, at
# 2, 4 and 8 ranks. Run from the repository root as
# `BEFORE=2d8523a BASE=/tmp/base_2d flock /tmp/mpisolve-cpu.lock perf/results/node_aware/round_parts/ab_node.sh`.
set -euo pipefail
MAIN=$(pwd)
# The editable install maps mpisolve.kernels to main's kernels/; a link makes the copy import its own.
[ -e "$BASE/mpisolve/kernels" ] || ln -s ../kernels "$BASE/mpisolve/kernels"
PY=$MAIN/.venv/bin/python
MPIEXEC=$MAIN/.venv/bin/mpiexec
ARGS=(--bytes 4096 65536 --calls 200 --blocks 10)
probe() {  # dir ranks
  cd "$1/perf"
  PYTHONPATH=$1 "$MPIEXEC" -n "$2" "$PY" bucket_round_parts.py "${ARGS[@]}"
  cd "$MAIN"
}
for round in 1 2 3; do
  for ranks in 2 4 8; do
    echo "== round $round n$ranks A $BEFORE $(date -u +%H:%M:%S) $(uptime)"
    probe "$BASE" "$ranks"
    echo "== round $round n$ranks B $(git rev-parse --short HEAD)+ $(date -u +%H:%M:%S) $(uptime)"
    probe "$MAIN" "$ranks"
  done
done
