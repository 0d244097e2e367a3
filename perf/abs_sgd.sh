#!/usr/bin/env bash
# The ABS-SGD heterogeneous-cluster study (issues 5 and 19), one command: bash perf/abs_sgd.sh
# Write-up, figures and provenance: docs/studies/abs-sgd.md
#
# 4 ranks; the homogeneous cluster, the three presets of mpisolve/train/hetero.py and
# moving-straggler (straggler, the slow rank changing every 2 s: --hetero-every); the
# MLP on digits; every solver trained to the same target test accuracy (stopping there),
# once per seed (SEEDS, default 0 to 4: the model's initialisation and the data order).
# Each (model, cluster, seed) is one `mpisolve compare` job, written to
# OUT/mlp-<cluster>/seed<k>, and each job holds the CPU lock alone (one run per hold, 1-2
# minutes; CLUSTERS picks clusters). perf/abs_sgd_report.py then writes results.csv,
# results.json, table.md and abs_sgd.png into OUT (medians over the seeds) and prints the
# verdicts.
#
# Every rank computes on an emulated device (--device-ms 10: a micro-batch of n samples
# takes factor x n x 10 ms, real compute included), so 4 ranks sharing 2 cores behave as
# 4 devices; the summaries count the micro-batches whose real compute overran it. 4 samples
# per rank and micro-batch (lb-bsp and abs-sgd split those 16 by speed), lr 0.02 with momentum 0.9; evaluation every 0.1 epoch (time to
# target is read there). async-sgd diverges at lr 0.02 (4 workers' pushes add up) and runs
# in a job of its own at lr 0.005, pushing every step (ASYNC_SGD): on straggler, the faster
# of lr 0.005 and 0.01 with tau 1 over seeds 0-4 (tau 4 was slower or missed in seed 0).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
OUT=${OUT:-perf/results/abs_sgd}
LOCK=${LOCK:-/tmp/mpisolve-cpu.lock}
CLUSTERS=${CLUSTERS:-homogeneous straggler two-tier graded moving-straggler}
SEEDS=${SEEDS:-0 1 2 3 4}
SOLVERS=abs-sgd,allreduce,lb-bsp,local-sgd
WORKLOAD="--model mlp --dataset digits --batch-size 4 --momentum 0.9 --epochs 3 --eval-every 0.1 --log-every 50
 --target-accuracy 0.96 --stop-at-target --device-ms 10"
ASYNC_SGD="--lr 0.005 --set async-sgd.tau=1 --set async-sgd.nonfinite=skip"
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-600}

for preset in $CLUSTERS; do
    case $preset in
        homogeneous) hetero="" ;;
        moving-straggler) hetero="--hetero straggler --hetero-every 2" ;;  # the 4x straggler moves every 2 s
        *) hetero="--hetero $preset" ;;
    esac
    for seed in $SEEDS; do
        echo "== mlp, $preset, seed $seed $(date +%T)" >&2
        dir="$OUT/mlp-$preset/seed$seed"
        # shellcheck disable=SC2086
        flock "$LOCK" timeout "$MPIEXEC_TIMEOUT" "$VENV/bin/mpiexec" -n 4 "$VENV/bin/python" -m mpi4py -m mpisolve \
            compare --solvers "$SOLVERS" $WORKLOAD --lr 0.02 $hetero --seed "$seed" --out "$dir"
        # shellcheck disable=SC2086
        flock "$LOCK" timeout "$MPIEXEC_TIMEOUT" "$VENV/bin/mpiexec" -n 4 "$VENV/bin/python" -m mpi4py -m mpisolve \
            compare --solvers async-sgd $WORKLOAD $ASYNC_SGD $hetero --seed "$seed" --out "$dir/async-sgd"
    done
done
"$VENV/bin/python" perf/abs_sgd_report.py "$OUT"
