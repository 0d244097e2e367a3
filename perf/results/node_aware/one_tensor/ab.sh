#!/usr/bin/env bash
# `bench sweep --ops mpi,average` from 4 KiB to 64 MiB on one node (2, 4, 8 ranks) and on the emulated 2x2 and 2x3
# clusters, A = $BEFORE (a git archive of it in $BASE, run from that copy so that its mpisolve is imported) against
# B = main's checkout, alternating, two rounds; then B alone with `--ops mpi,sum,average` once per layout. Run from the
# repository root as `BEFORE=2d97017 BASE=/tmp/base_2d9 flock /tmp/mpisolve-cpu.lock perf/results/node_aware/one_tensor/ab.sh`;
# JSON per run and the log (ab-<main's commit>.log) in this directory.
set -euo pipefail
source perf/results/node_aware/leader/common.sh
HERE=$MAIN/perf/results/node_aware/one_tensor
sweep() {  # dir label layout ops
  mpisolve_on "$1" "$3" bench sweep --ops "$4" --min-bytes 4K --max-bytes 64M --factor 4 > "$HERE/ab-$2.json"
}
{
  for round in 1 2; do
    for layout in n2 n4 n8 2x2 2x3; do
      echo "== round $round $layout A $BEFORE $(date -u +%H:%M:%S) $(uptime)"
      sweep "$BASE" "r$round-$layout-$BEFORE" "$layout" mpi,average
      echo "== round $round $layout B $AFTER $(date -u +%H:%M:%S) $(uptime)"
      sweep "$MAIN" "r$round-$layout-$AFTER" "$layout" mpi,average
    done
  done
  for layout in n2 n4 n8 2x2 2x3; do
    echo "== sum,average $layout B $AFTER $(date -u +%H:%M:%S) $(uptime)"
    sweep "$MAIN" "both-$layout-$AFTER" "$layout" mpi,sum,average
  done
} 2>&1 | grep -v "^MPICH: freeing" | tee "$HERE/ab-$AFTER.log"
