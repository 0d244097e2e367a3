#!/usr/bin/env bash
# Every solver's one-rank step over plain PyTorch's, MLP, batch 32, on the CPU: before = $BEFORE (a git archive of it in
# $BASE, run from that copy, so that its mpisolve is imported) and after = $AFTER (main's checkout), alternating, three
# rounds with the default nonfinite="raise", then one round of each with nonfinite="ignore".
# Run from /work/main as `flock /tmp/mpisolve-cpu.lock perf/results/one_rank/ab-de746d0.sh` (BASE=/tmp/base holds
# `git archive $BEFORE`); output in $OUT (default: beside this script). First run: BEFORE=bd0310d AFTER=de746d0 (the host adds a CPU finite
# check's sums); second: BEFORE=bd0310d AFTER=9b8edf0
# OUT=$HERE/ab-9b8edf0 (and sums them last to first).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
MAIN=$(cd "$HERE/../../.." && pwd)
BASE=${BASE:-/tmp/base}
BEFORE=${BEFORE:-bd0310d}
AFTER=${AFTER:-de746d0}
OUT=${OUT:-$HERE}
mkdir -p "$OUT"
PY=$MAIN/.venv/bin/python
ARGS=(--model mlp --batch 32 --repeats 200 --warmup 20)
run() {  # label dir extra...
  local label=$1 dir=$2; shift 2
  echo "== $label $(uptime)"
  (cd "$dir" && PYTHONPATH=$dir $PY -m mpi4py -m perf.gpu.every_solver "${ARGS[@]}" "$@") > "$OUT/cpu-mlp-2026-11-29-$label.jsonl"
}
echo "start $(date -u +%FT%TZ)"
for k in 1 2 3; do
  run "$BEFORE-r$k-default" "$BASE"
  run "$AFTER-r$k-default" "$MAIN"
done
run "$BEFORE-ignore" "$BASE" --set nonfinite=ignore
run "$AFTER-ignore" "$MAIN" --set nonfinite=ignore
echo "end $(date -u +%FT%TZ) $(uptime)"
