#!/bin/bash
# perf/one_tensor.py, A (main 06005c4 via PYTHONPATH=/tmp/wt33h-base) against B (branch issue33h), alternating,
# rounds (ROUNDS, default "1 2"; round 3 ran as ROUNDS=3) at 2 and 4 ranks, each run in its own hold of /tmp/mpisolve-cpu.lock. From /work/wt29.
W=/work/wt29
for round in ${ROUNDS:-1 2}; do
  for n in 2 4; do
    for side in A B; do
      if [ $side = A ]; then dir=/tmp/wt33h-base; export PYTHONPATH=/tmp/wt33h-base; else dir=$W; unset PYTHONPATH; fi
      (cd $dir && flock /tmp/mpisolve-cpu.lock bash -c "echo \"== r${round} n$n $side \$(date -u +%H:%M:%S) (\$(uptime | sed 's/.*load/load/'))\"; \
        timeout 300 $W/.venv/bin/mpiexec -n $n $W/.venv/bin/python $dir/perf/one_tensor.py --bytes 4096 262144 1048576 --calls 200 --blocks 20") 2>&1 | grep -v "freeing inactive"
    done
  done
done
