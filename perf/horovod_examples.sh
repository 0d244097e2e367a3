#!/usr/bin/env bash
# Horovod's examples/pytorch scripts, unchanged, on mpisolve.horovod (issue 32, item 4;
# docs/studies/horovod-suite.md, "Horovod's examples").
#
#   perf/horovod_examples.sh HOROVOD_TREE          (or HOROVOD_SRC=PATH)
#
# HOROVOD_TREE is a horovod/horovod source tree (fetched by the user; nothing from it is
# copied here). Its examples run as they are, `import horovod.torch as hvd` included,
# through the stand-in package perf/horovod_standin (whose `horovod.torch` is
# mpisolve.horovod), at RANKS ranks on the CPU, a few steps each (the examples' own flags),
# on data sets perf/horovod_examples_data.py writes into a scratch folder (WORK): nothing
# is downloaded. They need torchvision and tqdm in this Python; PyPI's torchvision wheel
# links its compiled operators against CUDA's torch, so beside a CPU-only torch
# perf/horovod_standin/torchvision_cpu lets it import without them (the examples use none).
# pytorch_lightning_mnist.py is not run: it needs a Lightning with
# `Trainer(accelerator='horovod')`, which Lightning has removed.
# Each run holds the CPU lock (LOCK; the synthetic benchmark prints img/s) and is bounded
# (`timeout`, MPISOLVE_TIMEOUT per wait). ONLY="regex" runs the runs whose name matches.
# Results: OUT/<run>.log (each run's output), OUT/summary.md (per run: the command, WORK
# standing for the scratch folder, its exit status and the lines it ended with).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

PY=${PY:-$ROOT/.venv/bin/python}
MPIEXEC=${MPIEXEC:-$ROOT/.venv/bin/mpiexec}
LOCK=${LOCK:-/tmp/mpisolve-cpu.lock}
OUT=${OUT:-$ROOT/perf/results/horovod_suite/examples}
RANKS=${RANKS:-2}
ONLY=${ONLY:-.}
SRC=${1:-${HOROVOD_SRC:-}}
[[ -n $SRC && -f $SRC/examples/pytorch/pytorch_mnist.py ]] || {
    echo "usage: $0 HOROVOD_TREE (a horovod/horovod source tree with examples/pytorch)" >&2
    exit 2
}
SRC=$(cd "$SRC" && pwd)/examples/pytorch
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$WORK"
export PYTHONPATH=$ROOT/perf/horovod_standin:$ROOT/perf/horovod_standin/torchvision_cpu
export MPISOLVE_TIMEOUT=${MPISOLVE_TIMEOUT:-120}
"$PY" -c "import tqdm" 2>/dev/null || "$PY" -m pip install --quiet tqdm
"$PY" -c "import torchvision" || {
    echo "torchvision is not importable: install the one built for this torch (pip install --no-deps torchvision==...)" >&2
    exit 2
}
"$PY" perf/horovod_examples_data.py mnist "$WORK/mnist"
"$PY" perf/horovod_examples_data.py imagenet "$WORK/imagenet"

{
    echo "# Horovod's examples/pytorch on mpisolve.horovod"
    echo
    echo "$(date -u +%FT%TZ), commit $(git rev-parse --short HEAD), $RANKS ranks, $(uptime | sed 's/.*load/load/')"
} > "$OUT/summary.md"

run() {  # run NAME PATTERN SCRIPT ARGS...: one example, unchanged; PATTERN picks its last lines
    local name=$1 pattern=$2 script=$3
    shift 3
    [[ $name =~ $ONLY ]] || return 0
    echo "== $name" >&2
    local rc=0
    (cd "$WORK" && flock "$LOCK" timeout 900 "$MPIEXEC" -n "$RANKS" "$PY" "$SRC/$script" "$@") \
        > "$OUT/$name.log" 2>&1 || rc=$?
    {
        echo
        echo "## $name"
        echo
        echo "    mpiexec -n $RANKS python $script ${*//"$WORK"/WORK}"
        echo
        echo "exit status $rc; it ended with:"
        echo
        tr '\r' '\n' < "$OUT/$name.log" | grep -E "$pattern" | tail -n 4 | sed 's/^/    /'
    } >> "$OUT/summary.md"
}

synthetic="Model:|img/sec|Error|error"
run synthetic "$synthetic" pytorch_synthetic_benchmark.py \
    --batch-size 2 --num-warmup-batches 1 --num-batches-per-iter 2 --num-iters 3
run synthetic-fp16 "$synthetic" pytorch_synthetic_benchmark.py --fp16-allreduce \
    --batch-size 2 --num-warmup-batches 1 --num-batches-per-iter 2 --num-iters 3
run synthetic-adasum "$synthetic" pytorch_synthetic_benchmark.py --use-adasum \
    --batch-size 2 --num-warmup-batches 1 --num-batches-per-iter 2 --num-iters 3

mnist="Test set|Error|error"
mnist_args=(--data-dir "$WORK/mnist" --epochs 3 --batch-size 32 --log-interval 10)
run mnist "$mnist" pytorch_mnist.py "${mnist_args[@]}"
run mnist-adasum "$mnist" pytorch_mnist.py "${mnist_args[@]}" --use-adasum
run mnist-fp16 "$mnist" pytorch_mnist.py "${mnist_args[@]}" --fp16-allreduce
run mnist-predivide "$mnist" pytorch_mnist.py "${mnist_args[@]}" --gradient-predivide-factor 2

imagenet="(Train|Validate) Epoch .*100%.*accuracy|Error|error"
imagenet_args=(--train-dir "$WORK/imagenet/train" --val-dir "$WORK/imagenet/validation"
    --batch-size 2 --val-batch-size 2)
# Epoch 1, then epochs 1-2 again: the second run resumes from the first's checkpoint (rank 0
# loads it; broadcast_parameters and broadcast_optimizer_state hand it to the others).
run imagenet "$imagenet" pytorch_imagenet_resnet50.py "${imagenet_args[@]}" --epochs 1 \
    --log-dir "$WORK/logs" --checkpoint-format "$WORK/checkpoint-{epoch}.pth.tar"
run imagenet-resume "$imagenet" pytorch_imagenet_resnet50.py "${imagenet_args[@]}" --epochs 2 \
    --log-dir "$WORK/logs" --checkpoint-format "$WORK/checkpoint-{epoch}.pth.tar"
run imagenet-accumulate-fp16 "$imagenet" pytorch_imagenet_resnet50.py "${imagenet_args[@]}" \
    --epochs 1 --batches-per-allreduce 2 --fp16-allreduce \
    --log-dir "$WORK/logs-acc" --checkpoint-format "$WORK/acc-checkpoint-{epoch}.pth.tar"
cat "$OUT/summary.md"
