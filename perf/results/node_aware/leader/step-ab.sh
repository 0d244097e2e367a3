#!/usr/bin/env bash
# `bench step --model {mlp,cnn} --batch 32 --solver allreduce` on the emulated 2x2 and 2x3 clusters (node-shared buckets
# on the bandwidth path, their exchanges between nodes polled in the solver), A = $BEFORE (a git archive of it in $BASE,
# run from that copy so that its mpisolve is imported) against B = main's checkout, alternating, two rounds. Run from
# the repository root as `BEFORE=fc209e8 BASE=/tmp/base_fc flock /tmp/mpisolve-cpu.lock perf/results/node_aware/leader/step-ab.sh`;
# JSON lines (steps-<main's commit>.jsonl) and the log (step-ab-<main's commit>.log) in this directory.
set -euo pipefail
source perf/results/node_aware/leader/common.sh
step() {  # dir hosts ranks model
  (cd "$1" && "$MPIEXEC" "${SSH[@]}" -hosts "$2" -n "$3" -env PYTHONPATH "$1" "$PY" -m mpi4py -m mpisolve \
    bench step --model "$4" --batch 32 --solver allreduce --repeats 60 --warmup 10 2>/dev/null | tail -1)
}
{
  for round in 1 2; do
    for layout in "a:2,b:2 4 2x2" "a:3,b:3 6 2x3"; do
      for model in mlp cnn; do
        for side in "A $BEFORE $BASE" "B $AFTER $MAIN"; do
          set -- $layout $side
          echo "== round $round $3 $model $4 $5 $(date -u +%H:%M:%S) $(uptime)"
          step "$6" "$1" "$2" "$model" | tee -a "$HERE/steps-$AFTER.jsonl"
        done
      done
    done
  done
} 2>&1 | tee "$HERE/step-ab-$AFTER.log"
