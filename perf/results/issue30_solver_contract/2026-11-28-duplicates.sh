#!/bin/bash
# issue 30's duplicates (branch issue30f) against 7f04be6 (main before it): perf/step_ab.py for the six
# window solvers (their classes now made by one helper) and the allreduce step (2 ranks on one node:
# node-shared sums, whose slot kernels now take a round's arguments as one tuple), 3 alternating rounds,
# every run under the CPU lock; then the slot kernels' per-call time (2026-11-28-slot-calls.py),
# alternating. `uptime` before each.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
BEFORE_REV=${BEFORE_REV:-7f04be6}
export PERF_LOCK=${PERF_LOCK:-/tmp/mpisolve-cpu.lock}
PY=$ROOT/.venv/bin/python
for solver in async-sgd async-msgd hogwild-sgd async-easgd async-measgd ea-wild allreduce; do
  echo "# $solver, uptime: $(uptime)"
  "$PY" "$ROOT/perf/step_ab.py" --revisions "$BEFORE_REV" worktree --ranks 2 --rounds 3 -- \
    --model mlp --solver "$solver" --repeats 30 --warmup 5
done
BEFORE=$(mktemp -d)
trap 'rm -rf "$BEFORE"' EXIT
git -C "$ROOT" archive "$BEFORE_REV" | tar -x -C "$BEFORE"
ln -s ../kernels "$BEFORE/mpisolve/kernels"
for round in 1 2 3; do
  for side in before worktree; do
    path=$([ $side = before ] && echo "$BEFORE")
    echo "# slot calls $side ($BEFORE_REV if before) round $round, uptime: $(uptime)"
    (cd "$BEFORE" && PYTHONPATH=$path flock "$PERF_LOCK" "$PY" "$HERE/2026-11-28-slot-calls.py" 64)
  done
done
