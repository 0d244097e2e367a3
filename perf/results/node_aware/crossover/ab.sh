#!/usr/bin/env bash
# `bench sweep --ops mpi,bucketed,bucketed-node,bucketed-mpi` from 1 MiB to 64 MiB on the emulated 2x2 and 2x3 clusters,
# A = $BEFORE (a git archive of it in $BASE, run from that copy so that its mpisolve is imported) against B = main's
# checkout, alternating, two rounds. Run from the repository root as
# `BEFORE=a727c38 BASE=/tmp/base_a7 flock /tmp/mpisolve-cpu.lock perf/results/node_aware/crossover/ab.sh`;
# JSON lines and the log (ab-<main's commit>.log) in this directory.
set -euo pipefail
MAIN=$(pwd)
HERE=$MAIN/perf/results/node_aware/crossover
AFTER=$(git rev-parse --short HEAD)
# The editable install maps mpisolve.kernels to main's kernels/; a link makes the copy import its own.
[ -e "$BASE/mpisolve/kernels" ] || ln -s ../kernels "$BASE/mpisolve/kernels"
PY=$MAIN/.venv/bin/python
MPIEXEC=$MAIN/.venv/bin/mpiexec
SSH=(-launcher ssh -launcher-exec "$MAIN/tests/cluster/fake-ssh")
ARGS=(bench sweep --ops mpi,bucketed,bucketed-node,bucketed-mpi --min-bytes 1M --max-bytes 64M --factor 2 --repeats 10)
sweep() {  # dir label hosts ranks
  (cd "$1" && "$MPIEXEC" "${SSH[@]}" -hosts "$3" -n "$4" -env PYTHONPATH "$1" "$PY" -m mpi4py -m mpisolve "${ARGS[@]}") \
    > "$HERE/ab-$2.json"
}
{
  for round in 1 2; do
    for layout in "a:2,b:2 4 2x2" "a:3,b:3 6 2x3"; do
      set -- $layout
      echo "== round $round $3 A $BEFORE $(date -u +%H:%M:%S) $(uptime)"
      sweep "$BASE" "r$round-$3-$BEFORE" "$1" "$2"
      echo "== round $round $3 B $AFTER $(date -u +%H:%M:%S) $(uptime)"
      sweep "$MAIN" "r$round-$3-$AFTER" "$1" "$2"
    done
  done
} 2>&1 | grep -v "^MPICH: freeing" | tee "$HERE/ab-$AFTER.log"
