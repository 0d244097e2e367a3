#!/usr/bin/env bash
# Whether a node-shared round's probe of MPI's progress engine between polls (0a35015) costs the small rounds anything:
# `bench sweep --ops mpi,bucketed,average` from 4 KiB to 1 MiB on one node (2, 4 ranks) and on the emulated 2x2 and 2x3
# clusters, A = $BEFORE (a git archive of it in $BASE) against B = main's checkout, alternating, two rounds. Run from the
# repository root as `BEFORE=b11898e BASE=/tmp/base_b11 flock /tmp/mpisolve-cpu.lock perf/results/node_aware/one_tensor/probe-ab.sh`;
# the ratio tables in the log (probe-ab-<main's commit>.log) in this directory.
set -euo pipefail
source perf/results/node_aware/leader/common.sh
HERE=$MAIN/perf/results/node_aware/one_tensor
sweep() {  # dir layout
  mpisolve_on "$1" "$2" bench sweep --ops mpi,bucketed,average --min-bytes 4K --max-bytes 1M --factor 4 \
    --small-repeats 400 2>&1 >/dev/null | grep -v "^MPICH: freeing"
}
{
  for round in 1 2; do
    for layout in n2 n4 2x2 2x3; do
      echo "== round $round $layout A $BEFORE $(uptime)"
      sweep "$BASE" "$layout"
      echo "== round $round $layout B $AFTER $(uptime)"
      sweep "$MAIN" "$layout"
    done
  done
} 2>&1 | tee "$HERE/probe-ab-$AFTER.log"
