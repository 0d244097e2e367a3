#!/usr/bin/env bash
# The ABS-SGD heterogeneous-cluster study (issue 5), one command: bash perf/abs_sgd.sh
#
# 4 ranks; the homogeneous cluster and the three presets of mpisolve/train/hetero.py; the
# MLP on digits; every solver trained to the same target test accuracy (stopping there).
# Each (model, cluster) is one `mpisolve compare` job; the clusters run under the CPU lock
# in groups (PRESET_GROUPS: groups separated by spaces, clusters in a group by commas; one
# hold of the lock per group, a few minutes each). perf/abs_sgd_report.py then writes
# results.csv, results.json and abs_sgd.png into OUT and prints the verdicts.
#
# Every rank computes on an emulated device (--device-ms 10: a micro-batch of n samples
# takes factor x n x 10 ms, real compute included), so 4 ranks sharing 2 cores behave as
# 4 devices; the summaries count the micro-batches whose real compute overran it. 4 samples
# per rank and micro-batch, plain lr 0.02 with momentum 0.9 for every solver; evaluation
# every 0.1 epoch (time to target is read there); async-sgd pushes every 4 local steps
# (its default is 1), as local-sgd averages every 4.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
OUT=${OUT:-perf/results/abs_sgd}
LOCK=${LOCK:-/tmp/mpisolve-cpu.lock}
PRESET_GROUPS=${PRESET_GROUPS:-homogeneous,straggler two-tier,graded}
SOLVERS=abs-sgd,allreduce,lb-bsp,async-sgd,local-sgd
WORKLOAD="--model mlp --dataset digits --batch-size 4 --lr 0.02 --momentum 0.9 --epochs 4 --eval-every 0.1 --log-every 50
 --target-accuracy 0.96 --stop-at-target --device-ms 10"
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-600}

# One group of clusters in one hold of the lock.
study() {
    local preset hetero
    for preset in ${1//,/ }; do
        hetero=""
        [ "$preset" = homogeneous ] || hetero="--hetero $preset"
        echo "== mlp, $preset $(date +%T)" >&2
        # shellcheck disable=SC2086
        timeout "$MPIEXEC_TIMEOUT" "$VENV/bin/mpiexec" -n 4 "$VENV/bin/python" -m mpi4py -m mpisolve compare \
            --solvers "$SOLVERS" $WORKLOAD $hetero --set async-sgd.tau=4 --set async-sgd.nonfinite=skip --out "$OUT/mlp-$preset"
    done
}
export -f study
export VENV OUT SOLVERS WORKLOAD
for group in $PRESET_GROUPS; do
    flock "$LOCK" bash -c "study $group"
done
"$VENV/bin/python" perf/abs_sgd_report.py "$OUT"
