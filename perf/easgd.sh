#!/usr/bin/env bash
# When asynchronous beats synchronous (issue 7; write-up: docs/studies/easgd-async.md): every solver of the EASGD family and
# "allreduce" (synchronous SGD) at 4 ranks, trained to a target accuracy on a
# communication-bound workload (the MLP on digits, micro-batch 8) and a compute-bound one
# (the CNN on the synthetic set, micro-batch 32); allreduce, easgd and ea-wild again with
# other seeds (repeats); then `advise` on both workloads (their computation/communication
# ratios); then results.csv, results.json and, per workload, accuracy_vs_time.png and
# accuracy_vs_epochs.png (seed 0) in perf/results/easgd.
#
#   perf/easgd.sh                   # each piece waits for the CPU lock (/tmp/mpisolve-cpu.lock)
#   MPISOLVE_LOCK= perf/easgd.sh    # a machine of your own (or a lock already held): no lock
#   perf/easgd.sh mlp               # one workload's pieces (mlp or cnn), then the merge
#   PIECES="repeats advise" perf/easgd.sh mlp   # some pieces only: main, sgd, nesterov, repeats, advise
#
# Every rank runs on an emulated device (--device-ms: a micro-batch of n samples takes
# n x MS ms, the real compute included; docs/guide/cli.md, "Emulated devices"): 4 ranks share 2
# cores here, and without it a solver that keeps every rank computing slows its own
# ranks down, which a cluster with a device per worker would not. Communication is real.
# MS is fixed per workload, the same for every solver (--device-ms auto would measure it
# again for each solver of a compare): the MLP's 2 ms per sample (16 ms per micro-batch)
# is below its gradient allreduce, the CNN's 6 ms (192 ms) far above its.
#
# The solvers share the user's optimizer (SGD, --lr, --momentum 0.9), but async-msgd and
# async-measgd add their own Nesterov momentum and so get --momentum 0: they run in a
# compare of their own. Solver options are the defaults (tau 4 and alpha 0.9/4 for the
# elastic ones, tau 1 for the others; sharded windows; progress thread). The push-every-step
# solvers (async-sgd, hogwild-sgd, async-msgd) and async-measgd can diverge at this
# learning rate: they skip non-finite steps (nonfinite=skip) instead of stopping the compare.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${VENV:-.venv}/bin
OUT=${OUT:-perf/results/easgd}
LOCK=${MPISOLVE_LOCK-/tmp/mpisolve-cpu.lock}
PIECES=${PIECES:-main sgd nesterov repeats advise}
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-600}

mpisolve4() {  # mpisolve under mpiexec at 4 ranks, holding the lock for this piece only
    local cmd=("$BIN/mpiexec" -n 4 "$BIN/python" -m mpi4py -m mpisolve "$@")
    if [ -n "$LOCK" ]; then flock "$LOCK" "${cmd[@]}"; else "${cmd[@]}"; fi
}

declare -A WORKLOAD=(
    [mlp]="--model mlp --dataset digits --batch-size 8 --lr 0.05 --device-ms 2 --epochs 6 --eval-every 0.5 --log-every 1000 --target-accuracy 0.97"
    [cnn]="--model cnn --dataset synthetic --data-size 4000 --batch-size 32 --lr 0.05 --device-ms 6 --epochs 3 --eval-every 0.25 --log-every 1000 --target-accuracy 0.55"
)
declare -A ADVISE=([mlp]="--model mlp --dataset digits --batch-size 8 --device-ms 2" [cnn]="--model cnn --dataset synthetic --batch-size 32 --device-ms 6")
declare -A REPEATS=([mlp]="1 2" [cnn]="1")

has() { [[ " $PIECES " == *" $1 "* ]]; }

for name in ${*:-mlp cnn}; do
    w=${WORKLOAD[$name]}
    if has main; then
        mpisolve4 compare $w --momentum 0.9 --solvers allreduce,easgd,async-easgd,ea-wild --out "$OUT/$name/main"
    fi
    if has sgd; then
        mpisolve4 compare $w --momentum 0.9 --set nonfinite=skip --solvers async-sgd,hogwild-sgd --out "$OUT/$name/sgd"
    fi
    if has nesterov; then
        # Their own momentum (0.9, Nesterov) on top of the shared lr diverged (loss 631 at 5.5 epochs): lr 0.01.
        mpisolve4 compare $w --lr 0.01 --momentum 0 --set nonfinite=skip --solvers async-msgd,async-measgd --out "$OUT/$name/nesterov"
    fi
    if has repeats; then
        for seed in ${REPEATS[$name]}; do
            mpisolve4 compare $w --seed "$seed" --momentum 0.9 --solvers allreduce,easgd,ea-wild --out "$OUT/$name/repeat-seed$seed"
        done
    fi
    if has advise; then
        mpisolve4 advise ${ADVISE[$name]} --json > "$OUT/$name/advise.json"
    fi
    rm -f "$OUT/$name"/*/accuracy_vs_*.png
    logs=$(ls "$OUT/$name"/{main,sgd,nesterov}/*.jsonl 2>/dev/null || true)  # the pieces run so far
    if [ -n "$logs" ]; then "$BIN/python" -m mpisolve plot $logs --out "$OUT/$name"; fi
done
"$BIN/python" perf/easgd_results.py "$OUT"
