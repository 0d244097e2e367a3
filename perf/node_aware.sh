#!/usr/bin/env bash
# docs/studies/node-aware.md: node-shared gradient buckets and the hierarchical allreduce.
# Each measurement is one mpiexec run holding ${PERF_LOCK} exclusively (when set), so
# nothing else shares the cores while it measures. -> perf/results/node_aware/*.json, *.csv
#   1. bench allreduce on ResNet-18's gradients at 2, 4, 8 ranks on one node: node-shared
#      buckets, the same buckets on MPI's path, MPICH's contiguous Allreduce, gloo;
#   2. bench sweep 4 KiB - 64 MiB at 2, 4, 8 ranks (mpi, bucketed, sum);
#   3. the emulated 2-node cluster (tests/cluster/fake-ssh), 2x2 ranks: the same two benches,
#      the hierarchical path against flat MPI;
#   4. bench step at 4 ranks: the allreduce solver's training step against DDP on gloo, MLP and ResNet-18.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
MPIEXEC="$(dirname "$PY")/mpiexec"
OUT=perf/results/node_aware
mkdir -p "$OUT"
LOCK=(${PERF_LOCK:+flock "$PERF_LOCK"})
CLUSTER=(-launcher ssh -launcher-exec "$PWD/tests/cluster/fake-ssh" -hosts nodeA:2,nodeB:2)
bench() {  # bench NAME MPIEXEC-ARGS... -- BENCH-ARGS...
    local name=$1; shift
    local launch=()
    while [ "$1" != "--" ]; do launch+=("$1"); shift; done
    shift
    echo "== $name" >&2
    "${LOCK[@]}" "$MPIEXEC" "${launch[@]}" "$PY" -m mpi4py -m mpisolve bench "$@" | tail -n 1 > "$OUT/$name.json"
    cat "$OUT/$name.json" >&2
}
for n in 2 4 8; do
    bench "allreduce_resnet18_n$n" -n "$n" -- allreduce --model resnet18 --compare-paths --repeats 20 --warmup 3
done
for n in 2 4 8; do
    bench "sweep_n$n" -n "$n" -- sweep --ops mpi,bucketed,sum --min-bytes 4K --max-bytes 64M --factor 4 \
        --repeats 10 --small-repeats 50 --csv "$OUT/sweep_n$n.csv"
done
bench allreduce_resnet18_2x2 "${CLUSTER[@]}" -n 4 -- allreduce --model resnet18 --compare-paths --repeats 20 --warmup 3
bench sweep_2x2 "${CLUSTER[@]}" -n 4 -- sweep --ops mpi,bucketed,sum --min-bytes 4K --max-bytes 64M --factor 4 \
    --repeats 10 --small-repeats 50 --csv "$OUT/sweep_2x2.csv"
for model in mlp resnet18; do
    bench "step_${model}_n4" -n 4 -- step --model "$model" --repeats 20 --warmup 3
done
