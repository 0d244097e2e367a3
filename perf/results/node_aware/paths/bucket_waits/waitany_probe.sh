#!/bin/bash
# perf/bucket_waits.py at 2x2 and 2x3, alternating layouts, two rounds, each run in its own hold of the lock.
cd /work/wt32
for r in 1 2; do for k in 2 3; do
  flock /tmp/mpisolve-cpu.lock bash -c "echo \"round $r 2x$k \$(date -u +%H:%M:%S) \$(uptime)\"; MPISOLVE_EMULATED_CLUSTER=1 timeout 400 .venv/bin/mpiexec -launcher ssh -launcher-exec $PWD/tests/cluster/fake-ssh -hosts nodeA:$k,nodeB:$k -n $((2*k)) .venv/bin/python perf/bucket_waits.py --bytes 4096 65536 --blocks 4 --calls 30 2>&1 | grep -v 'UCX\|MPICH'"
done; done
