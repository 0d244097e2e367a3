#!/usr/bin/env bash
# The ABS-SGD heterogeneous-cluster study (issue 5), one command: bash perf/abs_sgd.sh
#
# 4 ranks; the homogeneous cluster and the three presets of mpisolve/train/hetero.py; an MLP
# on digits and ResNet-18 on a tiny synthetic set; every solver trained to the same target
# test accuracy (stopping there). Each (model, cluster) is one `mpisolve compare` job, run
# under the CPU lock on its own (short holds); perf/abs_sgd_report.py then writes
# results.csv, results.json and abs_sgd.png into OUT and prints the verdicts.
#
# Sized for a 2-core machine: ResNet-18 trains on 300 synthetic images (240 for training, 60 for testing),
# 4 per rank and micro-batch, to a low target. async-sgd pushes every 4 local steps (its
# default is 1), as local-sgd averages every 4.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
OUT=${OUT:-perf/results/abs_sgd}
LOCK=${LOCK:-/tmp/mpisolve-cpu.lock}
PRESETS=${PRESETS:-homogeneous straggler two-tier graded}
MODELS=${MODELS:-mlp resnet18}
SOLVERS=abs-sgd,allreduce,lb-bsp,async-sgd,local-sgd
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-600}

workload() {
    case $1 in
        mlp) echo "--model mlp --dataset digits --batch-size 32 --epochs 5 --eval-every 0.25 --target-accuracy 0.85" ;;
        resnet18) echo "--model resnet18 --dataset synthetic --data-size 300 --batch-size 4 --epochs 2 --eval-every 0.25 --target-accuracy 0.25" ;;
    esac
}

# One model's four clusters in one hold of the lock (a few minutes each).
study() {
    local model=$1 preset hetero
    for preset in $PRESETS; do
        hetero=""
        [ "$preset" = homogeneous ] || hetero="--hetero $preset"
        echo "== $model, $preset $(date +%T)" >&2
        # shellcheck disable=SC2046
        timeout "$MPIEXEC_TIMEOUT" "$VENV/bin/mpiexec" -n 4 "$VENV/bin/python" -m mpi4py -m mpisolve compare \
            --solvers "$SOLVERS" $(workload "$model") $hetero --stop-at-target --set async-sgd.tau=4 \
            --out "$OUT/$model-$preset"
    done
}
export -f study workload
export VENV OUT PRESETS SOLVERS
for model in $MODELS; do
    flock "$LOCK" bash -c "study $model"
done
"$VENV/bin/python" perf/abs_sgd_report.py "$OUT"
