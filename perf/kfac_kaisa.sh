#!/usr/bin/env bash
# mpisolve's K-FAC against KAISA (kfac-pytorch 0.4.2), same machine, back to back
# (issue 20, item 3; docs/studies/kfac-kaisa.md).
#
#   perf/kfac_kaisa.sh [PATH_TO_KFAC_PYTORCH_TREE]      (or KFAC_PYTORCH_SRC=PATH)
#
# kfac-pytorch is installed from the user's local tree into this Python's environment
# (pip --no-deps --no-build-isolation: nothing is downloaded); without a tree, only the
# mpisolve rows run. Same model (CIFAR ResNet-18), batch (BATCH per rank), ranks (RANKS),
# SGD lr 0.1 momentum 0.9, damping 1e-3, factor decay 0.95, KL clip 1e-3, for both
# methods (INVERSE and EIGEN). KAISA runs on a DDP model over torch.distributed gloo,
# launched with mpiexec (rank and size from MPI), with its default gradient-worker
# fraction (COMM-OPT); mpisolve runs spd-kfac at GRAD_WORKER_FRACTIONS.
#
# Each method is one hold of the exclusive CPU lock (LOCK), in which every kind of
# iteration runs, each with the implementations back to back, one mpiexec run per
# configuration (about 10-15 minutes in all at 4 ranks on 2 cores), so other work gets
# through between holds. Kinds: inverse (factors and inverses every step: the every-step
# figure), factor (factors every step, inverses at step 0 only) and plain (neither after
# step 0); the typical schedule (factors every 10 steps, inverses every 100) is weighted
# from them (perf/kfac_kaisa.py). ONLY="regex" runs the configurations whose name
# matches. Results: OUT/<name>.json (one JSON line each), OUT/<name>.load (the date,
# the commit and the load average before the run), OUT/cpu-samples.log (every 10 s of a
# hold: cores used by the runs and by anything else), OUT/table.md.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
MPIEXEC=${MPIEXEC:-.venv/bin/mpiexec}
LOCK=${LOCK:-/tmp/mpisolve-cpu.lock}
OUT=${OUT:-perf/results/kfac_kaisa}
RANKS=${RANKS:-4}
BATCH=${BATCH:-16}
ITERS=${ITERS:-3}
METHODS=${METHODS:-"inverse eigen"}
KINDS=${KINDS:-"inverse factor plain"}
GRAD_WORKER_FRACTIONS=${GRAD_WORKER_FRACTIONS:-"0"}
ONLY=${ONLY:-.}
SRC=${1:-${KFAC_PYTORCH_SRC:-}}
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-900}
mkdir -p "$OUT"

kaisa=0
if [[ -n $SRC ]]; then
    [[ -f $SRC/kfac/preconditioner.py ]] || { echo "$SRC is not a kfac-pytorch tree (no kfac/preconditioner.py)" >&2; exit 2; }
    [[ -n ${KFAC_KAISA_HOLD:-} ]] || "$PY" -m pip install --quiet --no-deps --no-build-isolation "$SRC"
    kaisa=1
else
    echo "no kfac-pytorch tree given (argument or KFAC_PYTORCH_SRC): mpisolve rows only" >&2
fi

run() {  # run NAME WARMUP ARGS...: one configuration (inside a hold of the lock)
    local name=$1 warmup=$2
    shift 2
    [[ $name =~ $ONLY ]] || return 0
    echo "== $name" >&2
    { date -u +%FT%TZ; git rev-parse --short HEAD; uptime; } > "$OUT/$name.load"  # when, which commit, the load before
    timeout 900 "$MPIEXEC" -n "$RANKS" "$PY" perf/kfac_kaisa.py worker --batch "$BATCH" --iters "$ITERS" \
        --warmup "$warmup" "$@" 2> "$OUT/$name.err" | grep '^{' > "$OUT/$name.json" \
        || { echo "$name failed: $OUT/$name.err" >&2; exit 1; }
}

if [[ -n ${KFAC_KAISA_HOLD:-} ]]; then  # inside one hold: every kind and implementation for one method
    method=$KFAC_KAISA_HOLD
    "$PY" perf/kfac_kaisa.py cpu >> "$OUT/cpu-samples.log" &  # what else ran beside the hold
    sampler=$!
    trap 'kill $sampler' EXIT
    for kind in $KINDS; do
        if (( kaisa )); then
            run "kaisa-$method-$kind" 2 --impl kaisa --method "$method" --kind "$kind"
        fi
        for fraction in $GRAD_WORKER_FRACTIONS; do
            # 4 warm-up iterations: spd-kfac's fusion plan is made after its profiled steps.
            run "mpisolve-spd-f$fraction-$method-$kind" 4 --impl mpisolve --variant spd-kfac \
                --grad-worker-fraction "$fraction" --method "$method" --kind "$kind"
        done
    done
    exit 0
fi

for method in $METHODS; do
    KFAC_KAISA_HOLD=$method flock "$LOCK" "$0" "$@"
done
"$PY" perf/kfac_kaisa.py table "$OUT"
