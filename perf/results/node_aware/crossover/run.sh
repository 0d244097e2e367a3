#!/usr/bin/env bash
# The crossover measured on each layout of this machine: `bench sweep` with the bucket path forced onto node-shared
# memory and onto MPI's path at every size, 4 KiB to 16 MiB, at 2, 4, 8 ranks on one node and on the emulated 2x2 and
# 2x3 clusters, two rounds. Run from the repository root as
# `flock /tmp/mpisolve-cpu.lock perf/results/node_aware/crossover/run.sh`; JSON lines and the log in this directory.
set -euo pipefail
HERE=perf/results/node_aware/crossover
PY=.venv/bin/python
MPIEXEC=.venv/bin/mpiexec
SSH=(-launcher ssh -launcher-exec "$PWD/tests/cluster/fake-ssh")
ARGS=(bench sweep --ops mpi,bucketed,bucketed-node,bucketed-mpi --min-bytes 4K --max-bytes 16M --factor 4
  --repeats 20 --small-repeats 100)
echo "commit $(git rev-parse --short HEAD)"
for round in 1 2; do
  for layout in n2 n4 n8 2x2 2x3; do
    echo "== round $round $layout $(date -u +%H:%M:%S) $(uptime)"
    case $layout in
      n*) "$MPIEXEC" -n "${layout#n}" "$PY" -m mpi4py -m mpisolve "${ARGS[@]}" ;;
      2x2) "$MPIEXEC" "${SSH[@]}" -hosts a:2,b:2 -n 4 "$PY" -m mpi4py -m mpisolve "${ARGS[@]}" ;;
      2x3) "$MPIEXEC" "${SSH[@]}" -hosts a:3,b:3 -n 6 "$PY" -m mpi4py -m mpisolve "${ARGS[@]}" ;;
    esac > "$HERE/round$round-$layout.json"
  done
done 2>&1 | grep -v "^MPICH: freeing" | tee "$HERE/run.log"
