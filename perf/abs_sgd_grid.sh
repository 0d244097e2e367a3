#!/usr/bin/env bash
# Does ABS-SGD converge wherever synchronous SGD does? (issue 19; docs/studies/abs-sgd.md)
# One command: bash perf/abs_sgd_grid.sh
#
# The grid: 4 ranks, the MLP on digits, momentum 0.9, 5 epochs, target 0.95 test accuracy
# (stopping there, evaluated every 0.25 epoch), every solver option at its default, over
#   CLUSTERS  homogeneous and the three --hetero presets (straggler, two-tier, graded)
#   MODES     real (each rank computes as fast as it can: 4 processes on 2 cores, the
#             communication a large share of the step) and emulated (--device-ms 4: a
#             micro-batch of n samples takes factor x n x 4 ms, the compute a large share)
#   BATCHES   8 and 32 samples per rank and micro-batch
#   LRS       0.02 and 0.05
#   SEEDS     0 1 2
# Each cell is one `mpisolve compare --solvers $SOLVERS` job, written to
# OUT/<cluster>-<mode>-b<batch>-lr<lr>/seed<k>; a cell already done is skipped, so an
# interrupted grid resumes. It checks convergence, not speed: the jobs run under the shared
# CPU lock (flock -s), one hold per job. SET adds solver options (`--set abs-sgd.KEY=VALUE
# ...`: the ablation runs the same grid with a factor switched off into another OUT).
# perf/abs_sgd_grid_report.py then writes OUT/grid.csv and OUT/grid.md and prints every cell
# where allreduce reached the target and abs-sgd did not.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
OUT=${OUT:-perf/results/abs_sgd_grid}
LOCK=${LOCK:-/tmp/mpisolve-cpu.lock}
CLUSTERS=${CLUSTERS:-homogeneous straggler two-tier graded}
MODES=${MODES:-real emulated}
BATCHES=${BATCHES:-8 32}
LRS=${LRS:-0.02 0.05}
SEEDS=${SEEDS:-0 1 2}
SOLVERS=${SOLVERS:-abs-sgd,allreduce}
SET=${SET:-}
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-600}

for cluster in $CLUSTERS; do
    hetero=""
    [ "$cluster" != homogeneous ] && hetero="--hetero $cluster"
    for mode in $MODES; do
        device=""
        [ "$mode" = emulated ] && device="--device-ms 4"
        for batch in $BATCHES; do
            for lr in $LRS; do
                for seed in $SEEDS; do
                    dir="$OUT/$cluster-$mode-b$batch-lr$lr/seed$seed"
                    [ -f "$dir/summary.json" ] && continue
                    echo "== $cluster $mode batch $batch lr $lr seed $seed $(date +%T)" >&2
                    mkdir -p "$(dirname "$dir")"
                    # shellcheck disable=SC2086
                    flock -s "$LOCK" timeout "$MPIEXEC_TIMEOUT" "$VENV/bin/mpiexec" -n 4 "$VENV/bin/python" -m mpi4py \
                        -m mpisolve compare --solvers "$SOLVERS" --model mlp --dataset digits --momentum 0.9 \
                        --epochs 5 --eval-every 0.25 --target-accuracy 0.95 --stop-at-target \
                        --batch-size "$batch" --lr "$lr" --seed "$seed" $hetero $device $SET --out "$dir" >"$dir.log" 2>&1
                done
            done
        done
    done
done
"$VENV/bin/python" perf/abs_sgd_grid_report.py "$OUT"
