#!/bin/bash
# issue 30's last duplicate pair (branch issue30g): Horovod's allreduce forms made from one parameter list
# (2026-11-28-horovod-forms.patch, applied to a throwaway worktree TRY of BEFORE_REV) against BEFORE_REV
# itself (a throwaway worktree BASE). Each tree runs with this worktree's venv and PYTHONPATH=tree, from
# /tmp (so no other tree shadows it). Per round, alternating: perf/horovod_latency.py, 4-byte
# hvd.allreduce against mpisolve.allreduce at 2 ranks; then the same forms' per-call time at 1 rank in
# one process (no peer: the Python around the call, which is what the patch changes). Every run under the
# CPU lock, `uptime` before each. BASE, TRY, ROUNDS and LATENCY_ARGS (horovod_latency.py's) may be set.
#   git worktree add --detach /tmp/wt30g-base 9a01134; git worktree add --detach /tmp/wt30g-try 9a01134
#   git -C /tmp/wt30g-try apply $PWD/perf/results/issue30_solver_contract/2026-11-28-horovod-forms.patch
#   ln -s ../kernels /tmp/wt30g-base/mpisolve/kernels; ln -s ../kernels /tmp/wt30g-try/mpisolve/kernels
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
PY=$ROOT/.venv/bin/python
MPIEXEC=$ROOT/.venv/bin/mpiexec
LOCK=${LOCK:-/tmp/mpisolve-cpu.lock}
BASE=${BASE:-/tmp/wt30g-base}
TRY=${TRY:-/tmp/wt30g-try}
LATENCY_ARGS=${LATENCY_ARGS:-"--sizes 4 --calls 200 --repeats 30"}
ONE_RANK='
import sys, timeit, torch, mpisolve, mpisolve.horovod as hvd
hvd.init()
x = torch.ones(1)
calls = {"allreduce": lambda: hvd.allreduce(x), "allreduce_": lambda: hvd.allreduce_(x),
         "grouped_allreduce_": lambda: hvd.grouped_allreduce_([x])}
print(mpisolve.__file__, {k: round(min(timeit.repeat(f, number=20000, repeat=7)) / 20000 * 1e6, 3) for k, f in calls.items()}, "us a call, best of 7")
'
cd /tmp || exit 1
for round in $(seq 1 "${ROUNDS:-3}"); do
  for side in BASE TRY; do
    tree=${!side}
    echo "# $side $(git -C "$tree" rev-parse --short HEAD) ($(git -C "$tree" diff --stat | tail -1)), round $round, uptime: $(uptime)"
    PYTHONPATH=$tree flock "$LOCK" "$MPIEXEC" -n 2 "$PY" "$tree/perf/horovod_latency.py" $LATENCY_ARGS
    echo "# $side one rank, uptime: $(uptime)"
    PYTHONPATH=$tree flock "$LOCK" "$PY" -c "$ONE_RANK"
  done
done
