#!/usr/bin/env bash
# `mpisolve.allreduce` of one 4 KiB tensor (`bench sweep --ops $OPS`, default mpi,sum; 1,000 timed calls) at 2 and 4 ranks on one
# node and on the emulated 2x2 and 2x3 clusters, A = $BEFORE (a git archive of it in $BASE) against B = main's
# checkout, alternating, three rounds. Run from the repository root as
# `BEFORE=2d97017 BASE=/tmp/base_2d9 flock /tmp/mpisolve-cpu.lock perf/results/node_aware/one_tensor/small-ab.sh`;
# the log (small-ab-<main's commit>.log) in this directory.
set -euo pipefail
source perf/results/node_aware/leader/common.sh
HERE=$MAIN/perf/results/node_aware/one_tensor
sweep() {  # dir layout
  mpisolve_on "$1" "$2" bench sweep --ops "${OPS:-mpi,sum}" --min-bytes 4K --max-bytes 4K --small-repeats 1000 2>&1 >/dev/null \
    | grep "^ *4096"
}
{
  for round in 1 2 3; do
    for layout in n2 n4 2x2 2x3; do
      echo "round $round $layout A $BEFORE $(sweep "$BASE" "$layout") B $AFTER $(sweep "$MAIN" "$layout") $(uptime)"
    done
  done
} 2>&1 | tee "$HERE/small-ab-$AFTER${TAG:-}.log"
