#!/usr/bin/env bash
# One `mpisolve compare` run per variant on the CNN at N ranks (digits, 32 samples a rank, 24 micro-batches a rank),
# ROUNDS times, each printing its steady iteration and the ranks' mean busy / comm / idle a step as perf/scaling.py
# reads them, and the load average. A variant is NAME=TREE:SOLVER[:KEY=VALUE,...], TREE a checkout run through
# PYTHONPATH with main's venv, KEY=VALUE the solver's options. LOG_EVERY: updates a record (1 for lockstep
# solvers; perf/scaling.py gives asynchronous ones 3 x N). MODEL (default cnn), BATCHES (micro-batches a rank,
# default 24) and PY (the venv's python, default main's) change the run. Run under the CPU lock, e.g.
#   N=4 flock /tmp/mpisolve-cpu.lock bash probe.sh after=/work/main:abs-sgd fixed=/work/main:abs-sgd:micro_batch=fixed
set -euo pipefail
N=${N:-4}; EP=$(python3 -c "print(${BATCHES:-24}*32*$N/1437)"); LOG_EVERY=${LOG_EVERY:-1}
PY=${PY:-/work/main/.venv/bin/python}; MODEL=${MODEL:-cnn}
for k in ${ROUNDS:-1 2}; do
  for variant in "$@"; do
    name=${variant%%=*}; IFS=: read -r tree solver settings <<< "${variant#*=}"
    sets=(); for s in ${settings//,/ }; do sets+=(--set "$solver.$s"); done
    out=/tmp/absprobe/n$N-$name-$k; rm -rf "$out"
    (cd "$tree" && PYTHONPATH=$tree OMP_NUM_THREADS=1 "$(dirname "$PY")/mpiexec" -n "$N" $PY -m mpi4py -m mpisolve \
      compare --solvers "$solver" --model "$MODEL" --dataset digits --batch-size 32 --momentum 0 --epochs "$EP" \
      --log-every "$LOG_EVERY" --eval-every 1000 --out "$out" "${sets[@]}" > "$out.log" 2>&1) || echo "FAIL $name"
    $PY - "$out/$solver.jsonl" "$name" "$N" "$(uptime)" <<'PY'
import sys
from pathlib import Path

sys.path.insert(0, "/work/main/perf")
from scaling import steady

log, name, ranks, uptime = sys.argv[1:]
s = steady(Path(log))
it = 32 * int(ranks) / s["samples_per_s"] * 1e3
split = " ".join(f"{key} {it * s[key]:5.2f}" for key in ("busy", "comm", "idle"))
print(f"n{ranks} {name:9s} it {it:6.2f} ms {split}  load{uptime.split('load average')[1]}", flush=True)
PY
  done
done
