#!/bin/bash
# The allreduce step, before and after, 4 pairs alternating order, each pair under the CPU lock.
cd /tmp
run() { local tree=$1; shift; local label=$1; shift
  out=$($tree/.venv/bin/mpiexec -n 2 $tree/.venv/bin/python -m mpi4py -m mpisolve bench "$@" 2>/dev/null | grep '^{' | head -1)
  echo "$label $(basename $tree) $out"; }
for round in 1 2 3 4; do
  if [ $((round % 2)) = 1 ]; then order="/work/wt29 /work/main"; else order="/work/main /work/wt29"; fi
  flock /tmp/mpisolve-cpu.lock bash -c "$(declare -f run); for t in $order; do run \$t step-allreduce step --model mlp --repeats 40 --warmup 10; done"
done
