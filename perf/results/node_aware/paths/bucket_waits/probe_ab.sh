#!/bin/bash
# A/B of perf/bucket_waits.py at 2x2 and 2x3, two rounds, under the lock.
W=/work/wt32
LOG=$1
FS="-launcher ssh -launcher-exec $W/tests/cluster/fake-ssh"
for round in 1 2; do
  for layout in 2 3; do
    for side in A B; do
      if [ $side = A ]; then export PYTHONPATH=/tmp/wt33f-base; else unset PYTHONPATH; fi
      echo "== round $round 2x$layout $side ($(uptime | sed 's/.*load/load/'))"
      flock /tmp/mpisolve-cpu.lock timeout 300 $W/.venv/bin/mpiexec $FS -hosts a:$layout,b:$layout -n $((2*layout)) \
        $W/.venv/bin/python $W/perf/bucket_waits.py --bytes 4096 65536 --calls 100 --blocks 10 2>&1 | grep -v "freeing inactive"
    done
  done
done
