#!/bin/bash
# Before (main at /work/main) and after (issue30 at /work/wt29), alternating, at 2 ranks, under the CPU lock.
cd /tmp
run() { # tree label args...
  local tree=$1; shift; local label=$1; shift
  out=$($tree/.venv/bin/mpiexec -n 2 $tree/.venv/bin/python -m mpi4py -m mpisolve bench "$@" 2>/dev/null | grep '^{' | head -1)
  echo "$label $(basename $tree) $out"
}
for round in 1 2 3; do
  for spec in "step-allreduce:step --model mlp --repeats 30 --warmup 5" \
              "step-adasum:step --model mlp --solver adasum --repeats 30 --warmup 5" \
              "step-local-sgd:step --model mlp --solver local-sgd --repeats 30 --warmup 5" \
              "step-kfac:step --model mlp --solver kfac --repeats 20 --warmup 5" \
              "allreduce-mlp:allreduce --model mlp --repeats 30 --warmup 5 --no-gloo" \
              "allreduce-resnet18:allreduce --model resnet18 --repeats 10 --warmup 3 --no-gloo"; do
    label=${spec%%:*}; args=${spec#*:}
    if [ $((round % 2)) = 1 ]; then order="/work/main /work/wt29"; else order="/work/wt29 /work/main"; fi
    flock /tmp/mpisolve-cpu.lock bash -c "$(declare -f run); for t in $order; do run \$t $label $args; done"
  done
done
