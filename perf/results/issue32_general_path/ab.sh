#!/bin/bash
# issue 32 item 5 / 33 item 1 (branch issue32g): the checked collectives' general path for small
# tensors, before (BASE: main 8156146) and after (TRY: the branch's commit defd2fe), each a throwaway
# worktree run with this worktree's venv and PYTHONPATH=tree, from /tmp (so no other tree shadows it).
# Both run this worktree's perf/horovod_latency.py (the same script file: it adds mpisolve.broadcast
# and hvd.allgather to --others). Per round, alternating BASE and TRY, at 2 then 4 ranks; every run
# under the CPU lock, `uptime` before each. BASE, TRY, ROUNDS, SIZES_N and LATENCY_ARGS may be set.
#   git worktree add --detach /tmp/wt32g-base 8156146; git worktree add --detach /tmp/wt32g-try defd2fe
#   ln -s ../kernels /tmp/wt32g-base/mpisolve/kernels; ln -s ../kernels /tmp/wt32g-try/mpisolve/kernels
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
PY=$ROOT/.venv/bin/python
MPIEXEC=$ROOT/.venv/bin/mpiexec
SCRIPT=$ROOT/perf/horovod_latency.py
LOCK=${LOCK:-/tmp/mpisolve-cpu.lock}
BASE=${BASE:-/tmp/wt32g-base}
TRY=${TRY:-/tmp/wt32g-try}
LATENCY_ARGS=${LATENCY_ARGS:-"--sizes 4,4096 --calls 200 --repeats 20 --others"}
cd /tmp || exit 1
for round in $(seq 1 "${ROUNDS:-3}"); do
  for n in ${SIZES_N:-2 4}; do
    for side in BASE TRY; do
      tree=${!side}
      echo "# $side $(git -C "$tree" rev-parse --short HEAD), $n ranks, round $round, uptime: $(uptime)"
      PYTHONPATH=$tree flock "$LOCK" "$MPIEXEC" -n "$n" "$PY" "$SCRIPT" $LATENCY_ARGS
    done
  done
done
