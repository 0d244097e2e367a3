#!/usr/bin/env bash
# perf/bucket_round_parts.py, A = $BEFORE (a git archive of it in $BASE, run from that copy so that its mpisolve is
# imported) against B = $AFTER (main's checkout), alternating, two rounds, on the emulated 2x2 and 2x3 clusters and on one
# node at 2 and 4 ranks with node-shared sums off (MPI's path). Run from the repository root as
# `BEFORE=92ee9ca AFTER=2de69a1 BASE=/tmp/base2 flock /tmp/mpisolve-cpu.lock perf/results/node_aware/round_parts/ab.sh`;
# the log is this directory's ab-$AFTER.log.
set -euo pipefail
MAIN=$(pwd)
# The editable install maps mpisolve.kernels to main's kernels/; a link makes the copy import its own.
[ -e "$BASE/mpisolve/kernels" ] || ln -s ../kernels "$BASE/mpisolve/kernels"
PY=$MAIN/.venv/bin/python
MPIEXEC=$MAIN/.venv/bin/mpiexec
SSH=(-launcher ssh -launcher-exec "$MAIN/tests/cluster/fake-ssh")
ARGS=(--bytes 4096 65536 --calls 100 --blocks 10)
probe() {  # dir layout
  local dir=$1 layout=$2
  cd "$dir/perf"
  case $layout in
    n*) PYTHONPATH=$dir MPISOLVE_NODE_SHM=0 "$MPIEXEC" -n "${layout#n}" "$PY" bucket_round_parts.py "${ARGS[@]}" ;;
    2x2) "$MPIEXEC" "${SSH[@]}" -hosts a:2,b:2 -n 4 -env PYTHONPATH "$dir" "$PY" bucket_round_parts.py "${ARGS[@]}" ;;
    2x3) "$MPIEXEC" "${SSH[@]}" -hosts a:3,b:3 -n 6 -env PYTHONPATH "$dir" "$PY" bucket_round_parts.py "${ARGS[@]}" ;;
  esac
  cd "$MAIN"
}
for round in 1 2; do
  for layout in 2x2 2x3 n2 n4; do
    echo "== round $round $layout A $BEFORE $(date -u +%H:%M:%S) $(uptime)"
    probe "$BASE" "$layout"
    echo "== round $round $layout B $AFTER $(date -u +%H:%M:%S) $(uptime)"
    probe "$MAIN" "$layout"
  done
done
