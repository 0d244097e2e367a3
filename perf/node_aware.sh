#!/usr/bin/env bash
# docs/studies/node-aware.md: node-shared gradient buckets and the hierarchical allreduce.
# Each rank count's benches run in one hold of ${PERF_LOCK} (exclusive, when set), so nothing
# else shares the cores while they measure. -> perf/results/node_aware/*.json, *.csv
# (bash perf/node_aware.sh [n2|n4|n8|2x2|2x3|adasum] runs one step alone.)
#   1. bench allreduce on ResNet-18's gradients at 2, 4, 8 ranks on one node: node-shared
#      buckets, the same buckets on MPI's path, MPICH's contiguous Allreduce, gloo;
#   2. bench sweep 4 KiB - 64 MiB at 2, 4, 8 ranks (mpi, bucketed, sum);
#   3. the emulated 2-node cluster (tests/cluster/fake-ssh), 2x2 and 2x3 ranks: the same two
#      benches, the hierarchical path against flat MPI;
#   4. bench step at 4 ranks: the allreduce solver's training step against DDP on gloo, MLP and ResNet-18;
#   5. bench adasum --compare-paths at 2, 4, 8 ranks: Adasum on the node path against its message path.
# (bash perf/node_aware.sh paths [RUN] runs only the path-selection sweeps: bench sweep at 2, 4, 8
# ranks and on the 2x2 and 2x3 emulated clusters, each in its own hold of ${PERF_LOCK}, the default
# crossovers; -> perf/results/node_aware/paths/RUN/sweep_*.json, *.csv and the ratio tables in run.log.)
# Then perf/node_aware_model.py fits the performance model's node level to step 1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
MPIEXEC="$(dirname "$PY")/mpiexec"
OUT=perf/results/node_aware
mkdir -p "$OUT"
CLUSTER=(-launcher ssh -launcher-exec "$PWD/tests/cluster/fake-ssh")
# One hold of ${PERF_LOCK} per rank count (a few minutes each): its benches run back to back.
held() {  # held STEP: run this script's STEP with the lock held exclusively
    if [ -n "${PERF_LOCK:-}" ]; then flock "$PERF_LOCK" bash "$0" "$1"; else bash "$0" "$1"; fi
}
bench() {  # bench NAME MPIEXEC-ARGS... -- BENCH-ARGS...
    local name=$1; shift
    local launch=()
    while [ "$1" != "--" ]; do launch+=("$1"); shift; done
    shift
    echo "== $name ($(uptime | sed 's/.*load/load/'))" >&2
    "$MPIEXEC" "${launch[@]}" "$PY" -m mpi4py -m mpisolve bench "$@" | tail -n 1 > "$OUT/$name.json"
    cat "$OUT/$name.json" >&2
}
sweep() {  # sweep NAME MPIEXEC-ARGS...
    local name=$1; shift
    bench "$name" "$@" -- sweep --ops mpi,bucketed,sum --min-bytes 4K --max-bytes 64M --factor 4 \
        --repeats 30 --small-repeats 200 --csv "$OUT/$name.csv"
}
paths_sweep() {  # paths_sweep LAYOUT RUN: the path-selection sweep of one layout
    local dir="paths/$2" launch=()
    mkdir -p "$OUT/$dir"
    case "$1" in
        n*) launch=(-n "${1#n}") ;;
        2x*) launch=("${CLUSTER[@]}" -hosts "nodeA:${1#2x},nodeB:${1#2x}" -n $((2 * ${1#2x}))) ;;
    esac
    bench "$dir/sweep_$1" "${launch[@]}" -- sweep --ops mpi,bucketed,sum --min-bytes 4K --max-bytes 64M --factor 4 \
        --repeats 20 --small-repeats 200 --csv "$OUT/$dir/sweep_$1.csv"
}
case "${1:-all}" in
    paths)
        run="${2:-$(date -u +%Y-%m-%dT%H%M)}"
        for layout in n2 n4 n8 2x2 2x3; do
            if [ -n "${PERF_LOCK:-}" ]; then flock "$PERF_LOCK" bash "$0" paths-one "$layout" "$run"; else bash "$0" paths-one "$layout" "$run"; fi
        done
        ;;
    paths-one)
        paths_sweep "$2" "$3"
        ;;
    all)
        for step in n4 n8 n2 2x2 2x3 adasum; do held "$step"; done
        "$PY" perf/node_aware_model.py
        ;;
    n4)
        bench allreduce_resnet18_n4 -n 4 -- allreduce --model resnet18 --compare-paths --repeats 20 --warmup 3
        sweep sweep_n4 -n 4
        for model in mlp resnet18; do bench "step_${model}_n4" -n 4 -- step --model "$model" --ddp --repeats 20 --warmup 3; done
        ;;
    n2 | n8)
        n=${1#n}
        bench "allreduce_resnet18_n$n" -n "$n" -- allreduce --model resnet18 --compare-paths --repeats 20 --warmup 3
        sweep "sweep_n$n" -n "$n"
        ;;
    adasum)
        for n in 2 4 8; do
            bench "adasum_resnet18_n$n" -n "$n" -- adasum --model resnet18 --compare-paths --repeats 10 --warmup 2
        done
        ;;
    2x2 | 2x3)
        k=${1#2x}
        hosts=(-hosts "nodeA:$k,nodeB:$k")
        bench "allreduce_resnet18_$1" "${CLUSTER[@]}" "${hosts[@]}" -n $((2 * k)) -- allreduce --model resnet18 \
            --compare-paths --repeats 20 --warmup 3
        sweep "sweep_$1" "${CLUSTER[@]}" "${hosts[@]}" -n $((2 * k))
        ;;
esac
