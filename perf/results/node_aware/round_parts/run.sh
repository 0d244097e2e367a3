#!/usr/bin/env bash
# perf/bucket_round_parts.py at 4 KiB and 64 KiB on one node (2, 4, 8 ranks) and on the emulated 2x2 and 2x3 clusters,
# two rounds. Run from the repository root as `flock /tmp/mpisolve-cpu.lock perf/results/node_aware/round_parts/run.sh`;
# the log is this directory's run.log.
set -euo pipefail
PY=.venv/bin/python
MPIEXEC=.venv/bin/mpiexec
SSH=(-launcher ssh -launcher-exec tests/cluster/fake-ssh)
ARGS=(--bytes 4096 65536 --calls 100 --blocks 10)
cd perf
for round in 1 2; do
  for layout in n2 n4 n8 2x2 2x3; do
    echo "== round $round $layout $(date -u +%H:%M:%S) $(uptime)"
    case $layout in
      n*) ../$MPIEXEC -n "${layout#n}" ../$PY bucket_round_parts.py "${ARGS[@]}" ;;
      2x2) ../$MPIEXEC "${SSH[@]/#tests/../tests}" -hosts a:2,b:2 -n 4 ../$PY bucket_round_parts.py "${ARGS[@]}" ;;
      2x3) ../$MPIEXEC "${SSH[@]/#tests/../tests}" -hosts a:3,b:3 -n 6 ../$PY bucket_round_parts.py "${ARGS[@]}" ;;
    esac
  done
done
