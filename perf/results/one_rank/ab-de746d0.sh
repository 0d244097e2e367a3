#!/usr/bin/env bash
# Every solver's one-rank step over plain PyTorch's, MLP, batch 32, on the CPU: before = bd0310d (a git archive of it in
# $BASE, run from that copy, so that its mpisolve is imported) and after = de746d0 (the host adds a CPU finite check's sums),
# alternating, three rounds with the default nonfinite="raise", then one round of each with nonfinite="ignore".
# Run from /work/main as `flock /tmp/mpisolve-cpu.lock perf/results/one_rank/ab-de746d0.sh`
# (BASE=/tmp/base holds `git archive bd0310d`); output beside this script.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
MAIN=$(cd "$HERE/../../.." && pwd)
BASE=${BASE:-/tmp/base}
PY=$MAIN/.venv/bin/python
ARGS=(--model mlp --batch 32 --repeats 200 --warmup 20)
run() {  # label dir extra...
  local label=$1 dir=$2; shift 2
  echo "== $label $(uptime)"
  (cd "$dir" && PYTHONPATH=$dir $PY -m mpi4py -m perf.gpu.every_solver "${ARGS[@]}" "$@") > "$HERE/cpu-mlp-2026-11-29-$label.jsonl"
}
echo "start $(date -u +%FT%TZ)"
for k in 1 2 3; do
  run "bd0310d-r$k-default" "$BASE"
  run "de746d0-r$k-default" "$MAIN"
done
run "bd0310d-ignore" "$BASE" --set nonfinite=ignore
run "de746d0-ignore" "$MAIN" --set nonfinite=ignore
echo "end $(date -u +%FT%TZ) $(uptime)"
