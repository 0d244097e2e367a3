#!/usr/bin/env bash
# The asynchronous momentum solvers on the scaling study's CNN run (digits, batch 32 a rank, 200 micro-batches a rank, as
# perf/scaling.sh's real series), repeated, at several `momentum` values and rank counts: how often a run ends diverged.
# Run from the repository root as `flock /tmp/mpisolve-cpu.lock perf/results/easgd/momentum-workers/run.sh`; the log
# (each run's last line) is this directory's run.log (PART=2: run-2.log).
set -euo pipefail
run() {  # solver ranks momentum repeats
  local solver=$1 ranks=$2 momentum=$3 repeats=$4 epochs
  epochs=$(python3 -c "print(round(200 * 32 * $ranks / 1438, 6))")  # digits: 1438 training samples
  for i in $(seq "$repeats"); do
    echo "== $solver ranks=$ranks momentum=$momentum run=$i $(date -u +%H:%M:%S)"
    .venv/bin/mpiexec -n "$ranks" .venv/bin/python -m mpi4py -m mpisolve compare --solvers "$solver" \
      --set "momentum=$momentum" --model cnn --dataset digits --batch-size 32 --momentum 0 --epochs "$epochs" \
      --log-every 1000 --eval-every 1000 --out "/tmp/momentum-workers/$solver-$ranks-$momentum-$i" 2>&1 \
      | grep -E 'NonFinite|100%' | head -1 || true
  done
}
if [ "${PART:-1}" = 1 ]; then
  run async-msgd 8 0.9 8
  run async-msgd 8 0.7 6
  run async-msgd 8 0.5 6
  run async-msgd 4 0.9 6
  run async-measgd 8 0.99 6
  run async-measgd 8 0.9 6
fi
# Added after the first part had run (07:21 UTC): async-measgd's default at fewer ranks.
if [ "${PART:-1}" = 2 ]; then
  run async-measgd 4 0.99 6
  run async-measgd 2 0.99 6
fi
