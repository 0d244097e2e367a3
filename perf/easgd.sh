#!/usr/bin/env bash
# When asynchronous beats synchronous (issue 7): every solver of the EASGD family and
# "allreduce" (synchronous SGD) at 4 ranks, trained to a target accuracy on a
# communication-bound workload (the MLP on digits, micro-batch 8) and a compute-bound one
# (the CNN on the synthetic set, micro-batch 32); then `advise` on both workloads (their
# computation/communication ratios); then results.csv, results.json and, per workload,
# accuracy_vs_time.png and accuracy_vs_epochs.png in perf/results/easgd.
#
#   perf/easgd.sh                   # each piece waits for the CPU lock (/tmp/mpisolve-cpu.lock)
#   MPISOLVE_LOCK= perf/easgd.sh    # a machine of your own: no lock
#   perf/easgd.sh mlp               # one workload's pieces (mlp or cnn), then the merge
#
# The solvers share the user's optimizer (SGD, --lr, --momentum 0.9), but async-msgd and
# async-measgd add their own Nesterov momentum and so get --momentum 0: they run in a
# compare of their own. Solver options are the defaults (tau 4 and alpha 0.9/4 for the
# elastic ones, tau 1 for the others; sharded windows; progress thread).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${VENV:-.venv}/bin
OUT=${OUT:-perf/results/easgd}
LOCK=${MPISOLVE_LOCK-/tmp/mpisolve-cpu.lock}
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-600}

mpisolve4() {  # mpisolve under mpiexec at 4 ranks, holding the lock for this piece only
    local cmd=("$BIN/mpiexec" -n 4 "$BIN/python" -m mpi4py -m mpisolve "$@")
    if [ -n "$LOCK" ]; then flock "$LOCK" "${cmd[@]}"; else "${cmd[@]}"; fi
}

declare -A WORKLOAD=(
    [mlp]="--model mlp --dataset digits --batch-size 8 --lr 0.05 --epochs 2.5 --eval-every 0.25 --log-every 40 --target-accuracy 0.95"
    [cnn]="--model cnn --dataset synthetic --data-size 4000 --batch-size 32 --lr 0.05 --epochs 3 --eval-every 0.25 --log-every 40 --target-accuracy 0.55"
)
declare -A ADVISE=([mlp]="--model mlp --dataset digits --batch-size 8" [cnn]="--model cnn --dataset synthetic --batch-size 32")

for name in ${*:-mlp cnn}; do
    w=${WORKLOAD[$name]}
    mpisolve4 compare $w --momentum 0.9 --solvers allreduce,easgd,async-easgd,ea-wild --out "$OUT/$name/elastic"
    mpisolve4 compare $w --momentum 0.9 --solvers async-sgd,hogwild-sgd --out "$OUT/$name/sgd"
    mpisolve4 compare $w --momentum 0 --solvers async-msgd,async-measgd --out "$OUT/$name/nesterov"
    mpisolve4 advise ${ADVISE[$name]} --json > "$OUT/$name/advise.json"
    rm -f "$OUT/$name"/*/accuracy_vs_*.png
    "$BIN/python" -m mpisolve plot "$OUT/$name"/*/*.jsonl --out "$OUT/$name"
done
"$BIN/python" perf/easgd_results.py "$OUT"
