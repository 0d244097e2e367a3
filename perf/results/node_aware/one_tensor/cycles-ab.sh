#!/usr/bin/env bash
# cycles.py with A = $BEFORE (a git archive of it in $BASE) and B = main's checkout, alternating, two rounds, at 2 and
# 4 ranks and on the emulated 2x2 and 2x3 clusters. Run from the repository root as
# `BEFORE=cedabbc BASE=/tmp/base_ced flock /tmp/mpisolve-cpu.lock perf/results/node_aware/one_tensor/cycles-ab.sh`;
# the log (cycles-ab-<main's commit>.log) in this directory.
set -euo pipefail
source perf/results/node_aware/leader/common.sh
HERE=$MAIN/perf/results/node_aware/one_tensor
run() {  # dir layout
  local where
  read -ra where <<< "$(layout_args "$2")"
  (cd "$1" && "$MPIEXEC" "${where[@]}" -env PYTHONPATH "$1" "$PY" "$HERE/cycles.py")
}
{
  for round in 1 2; do
    for layout in n2 n4 2x2 2x3; do
      echo "round $round $layout $(uptime | sed 's/.*load/load/') A $BEFORE: $(run "$BASE" "$layout") | B $AFTER: $(run "$MAIN" "$layout")"
    done
  done
} 2>&1 | grep -v "^MPICH: freeing" | tee "$HERE/cycles-ab-$AFTER.log"
