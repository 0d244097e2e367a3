#!/usr/bin/env bash
# perf/bucket_paths.py (a model of one 2 MiB bucket and two small ones), A = $BEFORE (a git archive of it in $BASE, run
# from that copy so that its mpisolve is imported; the probe itself is main's, copied in) against B = $AFTER (in
# $AFTER_DIR, main's checkout by default), alternating, two rounds, on the emulated 2x2 and 2x3 clusters. Run from the
# repository root as `BEFORE=18d3fb4 AFTER=e787d5e BASE=/tmp/base_18 flock /tmp/mpisolve-cpu.lock
# perf/results/node_aware/bucket_paths/ab.sh` (main was at e787d5e; since its revert, AFTER_DIR=a git archive of it);
# the log is this directory's ab-$AFTER.log.
set -euo pipefail
MAIN=$(pwd)
HERE=$MAIN/perf/results/node_aware/bucket_paths
LOG=$HERE/ab-$AFTER.log
# The editable install maps mpisolve.kernels to main's kernels/; a link makes a copy import its own.
AFTER_DIR=${AFTER_DIR:-$MAIN}
for copy in "$BASE" "$AFTER_DIR"; do
  [ "$copy" = "$MAIN" ] && continue
  [ -e "$copy/mpisolve/kernels" ] || ln -s ../kernels "$copy/mpisolve/kernels"
  cp "$MAIN/perf/bucket_paths.py" "$copy/perf/bucket_paths.py"
done
PY=$MAIN/.venv/bin/python
MPIEXEC=$MAIN/.venv/bin/mpiexec
SSH=(-launcher ssh -launcher-exec "$MAIN/tests/cluster/fake-ssh")
ARGS=(--bytes 4096 65536 --calls 50 --blocks 10)
probe() {  # dir hosts ranks
  cd "$1/perf"
  "$MPIEXEC" "${SSH[@]}" -hosts "$2" -n "$3" -env PYTHONPATH "$1" "$PY" bucket_paths.py "${ARGS[@]}"
  cd "$MAIN"
}
{
  for round in 1 2; do
    for layout in "a:2,b:2 4" "a:3,b:3 6"; do
      set -- $layout
      echo "== round $round $1 A $BEFORE $(date -u +%H:%M:%S) $(uptime)"
      probe "$BASE" "$1" "$2"
      echo "== round $round $1 B $AFTER $(date -u +%H:%M:%S) $(uptime)"
      probe "$AFTER_DIR" "$1" "$2"
    done
  done
} 2>&1 | grep -v "^MPICH: freeing" | tee "$LOG"
