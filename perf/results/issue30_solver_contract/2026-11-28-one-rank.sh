#!/bin/bash
# The allreduce step at 1 rank (the solver's Python sequence, no communication), before and after, alternating.
cd /tmp
for round in 1 2 3; do
  if [ $((round % 2)) = 1 ]; then order="/work/main /work/wt29"; else order="/work/wt29 /work/main"; fi
  flock /tmp/mpisolve-cpu.lock bash -c "for t in $order; do echo \"step-allreduce-1rank \$(basename \$t) \$(\$t/.venv/bin/python -m mpisolve bench step --model mlp --repeats 200 --warmup 20 2>/dev/null | grep '^{' | head -1)\"; done"
done
