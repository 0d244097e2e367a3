#!/usr/bin/env bash
# Where ABS-SGD wins over LB-BSP, and where it does not (issue 19; docs/studies/abs-sgd.md).
# One command: bash perf/abs_sgd_regimes.sh
#
# The study's workload (perf/abs_sgd.sh: 4 ranks, the MLP on digits, 4 samples per rank,
# lr 0.02, momentum 0.9, emulated devices, time to 96% test accuracy) under --hetero
# straggler, with abs-sgd, lb-bsp and allreduce, SEEDS seeds (default 0 1 2), in three sweeps:
#   moving     the straggler moves to the next rank every S seconds (--hetero-every S,
#              S in PERIODS, default 1 2 4; and "static": it never moves), 10 ms per sample
#   drift      the same, each rank's speed sliding into the next rank's over the period
#              (--hetero-every S --hetero-drift): speeds that drift rather than jump
#   comm       the emulated device's time per sample (--device-ms M, M in DEVICE_MS, default
#              2.5 5 10 20): the shorter the compute, the larger the allreduce's share of a step
# Each (sweep, point, seed) is one `mpisolve compare` job under the exclusive CPU lock (one
# run per hold), written to OUT/<sweep>-<point>/seed<k>. perf/abs_sgd_regimes.py then writes
# OUT/regimes.csv, OUT/regimes.md and OUT/regimes.png.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
OUT=${OUT:-perf/results/abs_sgd_regimes}
LOCK=${LOCK:-/tmp/mpisolve-cpu.lock}
SEEDS=${SEEDS:-0 1 2}
PERIODS=${PERIODS:-1 2 4}
DEVICE_MS=${DEVICE_MS:-2.5 5 10 20}
SWEEPS=${SWEEPS:-moving drift comm}
WORKLOAD="--solvers abs-sgd,lb-bsp,allreduce --model mlp --dataset digits --batch-size 4 --lr 0.02 --momentum 0.9
 --epochs 3 --eval-every 0.1 --log-every 50 --target-accuracy 0.96 --stop-at-target --hetero straggler"
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-600}

run() {  # run POINT_DIR SEED FLAGS...
    local dir="$OUT/$1/seed$2"
    shift 2
    [ -f "$dir/summary.json" ] && return
    echo "== $dir $(date +%T)" >&2
    # shellcheck disable=SC2086
    flock "$LOCK" timeout "$MPIEXEC_TIMEOUT" "$VENV/bin/mpiexec" -n 4 "$VENV/bin/python" -m mpi4py -m mpisolve \
        compare $WORKLOAD "$@" --out "$dir" >/dev/null
}

for seed in $SEEDS; do
    for sweep in $SWEEPS; do
        if [ "$sweep" = moving ]; then
            for period in $PERIODS static; do
                every=""
                [ "$period" != static ] && every="--hetero-every $period"
                # shellcheck disable=SC2086
                run "moving-$period" "$seed" --device-ms 10 $every --seed "$seed"
            done
        elif [ "$sweep" = drift ]; then
            for period in $PERIODS; do
                run "drift-$period" "$seed" --device-ms 10 --hetero-every "$period" --hetero-drift --seed "$seed"
            done
        else
            for ms in $DEVICE_MS; do
                run "comm-$ms" "$seed" --device-ms "$ms" --seed "$seed"
            done
        fi
    done
done
"$VENV/bin/python" perf/abs_sgd_regimes.py "$OUT"
