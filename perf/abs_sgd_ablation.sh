#!/usr/bin/env bash
# Which of ABS-SGD's corrections makes it converge? (issue 19; docs/studies/abs-sgd.md)
# One command: bash perf/abs_sgd_ablation.sh
#
# Every combination of four factors, each on (the default) or off:
#   prediction   delay compensation: weight_prediction=1.5, off: 0
#   momentum     momentum_correction=true, off: false
#   lr           batch-proportional learning rate: on: lr_scaling=linear, off (the default): none
#   bounded      max_round_batches=1, off: none (rounds last until the allreduce completes)
# on make demo's configuration (4 ranks, --hetero straggler, the MLP on digits, batch 32,
# lr 0.05, momentum 0.9; real compute) and on the same with emulated devices
# (--device-ms 4), SEEDS seeds each (default 0-4), 5 epochs, target 0.95 (SCALINGS and
# BOUNDS restrict the last two factors: the emulated runs, whose rounds hold one
# micro-batch either way, take only SCALINGS=none BOUNDS=1): the grid's cells
# (perf/abs_sgd_grid.sh runs them, one job per seed under the shared lock), into
# OUT/<variant>/. perf/abs_sgd_ablation_report.py then writes OUT/ablation.csv and
# OUT/ablation.md: per variant and cell, the seeds that reached the target, the median
# epochs to it, the median final accuracy and updates, the mean global batch of an update.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
OUT=${OUT:-perf/results/abs_sgd_ablation}
SEEDS=${SEEDS:-0 1 2 3 4}
MODES=${MODES:-real emulated}
SCALINGS=${SCALINGS:-none linear}  # batch-proportional lr: off, on
BOUNDS=${BOUNDS:-1 none}           # bounded rounds: on, off
export VENV SEEDS MODES
for prediction in 1.5 0; do
    for momentum in true false; do
        for lr in $SCALINGS; do
            for bounded in $BOUNDS; do
                variant="prediction$prediction-momentum_$momentum-lr_$lr-bounded_$bounded"
                SET="--set abs-sgd.weight_prediction=$prediction --set abs-sgd.momentum_correction=$momentum"
                SET="$SET --set abs-sgd.lr_scaling=$lr --set abs-sgd.max_round_batches=$bounded"
                OUT="$OUT/$variant" CLUSTERS=straggler BATCHES=32 LRS=0.05 SOLVERS=abs-sgd SET="$SET" \
                    bash perf/abs_sgd_grid.sh >/dev/null
            done
        done
    done
done
"$VENV/bin/python" perf/abs_sgd_ablation_report.py "$OUT"
