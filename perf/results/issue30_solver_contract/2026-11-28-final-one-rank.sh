#!/bin/bash
# The one-rank allreduce step alone (the solver's Python sequence, no communication), 3 rounds: a second look at
# the 2026-11-28-final.txt one-rank figures. 03c9252 against this worktree, alternating; each run holds the CPU lock alone (short
# locked runs); `uptime` is recorded before each. The before tree is a `git archive` put first on
# PYTHONPATH (as perf/step_ab.py does); both run with this worktree's venv.
set -u
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
BEFORE_REV=${BEFORE_REV:-03c9252}
LOCK=${LOCK:-/tmp/mpisolve-cpu.lock}
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
  "step-allreduce-1rank|1|step --model mlp --repeats 200 --warmup 20"
)
# Unrecorded, unlocked: each side compiles its kernels into its own cache first.
for side in before after; do PYTHONPATH=$([ $side = before ] && echo "$TMP/before") "$PY" -m mpisolve bench step --model mlp --repeats 2 --warmup 1 >/dev/null 2>&1; done
for round in 1 2 3; do
  if [ $((round % 2)) = 1 ]; then order="before after"; else order="after before"; fi
  for spec in "${SPECS[@]}"; do
    IFS='|' read -r label ranks args <<<"$spec"
    for side in $order; do
      load=$(uptime | sed 's/.*load average: //')
      echo "$label $side round=$round load=[$load] $(run $side $ranks $args)"
    done
  done
done
