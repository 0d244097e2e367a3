#!/bin/bash
# issue 30's last part (the tally module, the duplicates): 03c9252 (main before the issue-30 merge)
# against this branch's worktree, alternating, 3 rounds. Each run holds the CPU lock alone (short
# locked runs); `uptime` is recorded before each. The before tree is a `git archive` put first on
# PYTHONPATH (as perf/step_ab.py does); both run with this worktree's venv.
set -u
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
BEFORE_REV=${BEFORE_REV:-03c9252}
LOCK=${LOCK:-/tmp/mpisolve-cpu.lock}
ROUNDS=${ROUNDS:-3}
ONLY=${ONLY:-}  # one label alone (2026-11-28-final-one-rank.txt: ONLY=step-allreduce-1rank)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir "$TMP/before"
git -C "$ROOT" archive "$BEFORE_REV" | tar -x -C "$TMP/before"
ln -s ../kernels "$TMP/before/mpisolve/kernels"
PY=$ROOT/.venv/bin/python
MPIEXEC=$ROOT/.venv/bin/mpiexec
cd "$TMP"
run() { # side ranks args...
  local side=$1 ranks=$2; shift 2
  local path=""
  [ "$side" = before ] && path="$TMP/before"
  local cmd=("$PY" -m mpisolve bench "$@")
  [ "$ranks" -gt 1 ] && cmd=("$MPIEXEC" -n "$ranks" "$PY" -m mpi4py -m mpisolve bench "$@")
  PYTHONPATH=$path flock "$LOCK" "${cmd[@]}" 2>/dev/null | grep '^{' | head -1
}
SPECS=(
  "step-allreduce|2|step --model mlp --repeats 30 --warmup 5"
  "step-adasum|2|step --model mlp --solver adasum --repeats 30 --warmup 5"
  "step-local-sgd|2|step --model mlp --solver local-sgd --repeats 30 --warmup 5"
  "step-kfac|2|step --model mlp --solver kfac --repeats 20 --warmup 5"
  "step-allreduce-1rank|1|step --model mlp --repeats 200 --warmup 20"
  "allreduce-mlp|2|allreduce --model mlp --repeats 30 --warmup 5 --no-gloo"
  "allreduce-resnet18|2|allreduce --model resnet18 --repeats 10 --warmup 3 --no-gloo"
)
# Unrecorded, unlocked: each side compiles its kernels into its own cache first.
for side in before after; do PYTHONPATH=$([ $side = before ] && echo "$TMP/before") "$PY" -m mpisolve bench step --model mlp --repeats 2 --warmup 1 >/dev/null 2>&1; done
for round in $(seq "$ROUNDS"); do
  if [ $((round % 2)) = 1 ]; then order="before after"; else order="after before"; fi
  for spec in "${SPECS[@]}"; do
    IFS='|' read -r label ranks args <<<"$spec"
    [ -n "$ONLY" ] && [ "$label" != "$ONLY" ] && continue
    for side in $order; do
      load=$(uptime | sed 's/.*load average: //')
      echo "$label $side round=$round load=[$load] $(run $side $ranks $args)"
    done
  done
done
