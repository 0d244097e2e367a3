#!/usr/bin/env bash
# mpisolve.horovod against the solvers and collectives underneath (issue 32, item 5;
# docs/studies/horovod-suite.md), same run, same machine:
#   - `bench step --solver allreduce --horovod`: hvd.DistributedOptimizer's step beside the
#     allreduce solver's, MODEL (ResNet-18) at each of RANKS, BATCH per rank;
#   - perf/horovod_latency.py: hvd.allreduce of one tensor beside mpisolve.allreduce's.
# Each run holds the CPU lock (LOCK). Results: OUT/step-<model>-n<N>.json,
# OUT/latency-n<N>.json (JSON lines), and OUT/*.load (date, commit, load average before each run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
MPIEXEC=${MPIEXEC:-.venv/bin/mpiexec}
LOCK=${LOCK:-/tmp/mpisolve-cpu.lock}
OUT=${OUT:-perf/results/horovod_step}
RANKS=${RANKS:-"2 4"}
MODEL=${MODEL:-resnet18}
BATCH=${BATCH:-32}
REPEATS=${REPEATS:-10}
mkdir -p "$OUT"

stamp() { { date -u +%FT%TZ; git rev-parse --short HEAD; uptime; } > "$OUT/$1.load"; }
for n in $RANKS; do
    stamp "step-$MODEL-n$n"
    flock "$LOCK" timeout 1800 "$MPIEXEC" -n "$n" "$PY" -m mpi4py -m mpisolve bench step --solver allreduce \
        --horovod --model "$MODEL" --batch "$BATCH" --repeats "$REPEATS" --warmup 2 > "$OUT/step-$MODEL-n$n.json"
    stamp "latency-n$n"
    flock "$LOCK" timeout 900 "$MPIEXEC" -n "$n" "$PY" -m mpi4py perf/horovod_latency.py > "$OUT/latency-n$n.json"
done
cat "$OUT"/step-*.json "$OUT"/latency-*.json
