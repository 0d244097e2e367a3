#!/usr/bin/env bash
# `bench sweep --ops mpi,bucketed,bucketed-node,bucketed-mpi,average` from 4 KiB to 4 MiB on one node (2, 4, 8 ranks) and
# on the emulated 2x2 and 2x3 clusters, A = $BEFORE (a git archive of it in $BASE, run from that copy so that its mpisolve
# is imported) against B = main's checkout, alternating, two rounds. Run from the repository root as
# `BEFORE=fc209e8 BASE=/tmp/base_fc flock /tmp/mpisolve-cpu.lock perf/results/node_aware/leader/ab.sh`;
# JSON lines and the log (ab-<main's commit>.log) in this directory.
set -euo pipefail
source perf/results/node_aware/leader/common.sh
ARGS=(bench sweep --ops mpi,bucketed,bucketed-node,bucketed-mpi,average --min-bytes 4K --max-bytes 4M)
sweep() {  # dir label layout
  local where=()
  case $3 in
    n*) where=(-n "${3#n}") ;;
    2x2) where=("${SSH[@]}" -hosts a:2,b:2 -n 4) ;;
    2x3) where=("${SSH[@]}" -hosts a:3,b:3 -n 6) ;;
  esac
  (cd "$1" && "$MPIEXEC" "${where[@]}" -env PYTHONPATH "$1" "$PY" -m mpi4py -m mpisolve "${ARGS[@]}") > "$HERE/ab-$2.json"
}
{
  for round in 1 2; do
    for layout in n2 n4 n8 2x2 2x3; do
      echo "== round $round $layout A $BEFORE $(date -u +%H:%M:%S) $(uptime)"
      sweep "$BASE" "r$round-$layout-$BEFORE" "$layout"
      echo "== round $round $layout B $AFTER $(date -u +%H:%M:%S) $(uptime)"
      sweep "$MAIN" "r$round-$layout-$AFTER" "$layout"
    done
  done
} 2>&1 | grep -v "^MPICH: freeing" | tee "$HERE/ab-$AFTER.log"
