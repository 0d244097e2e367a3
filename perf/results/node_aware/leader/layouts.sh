#!/usr/bin/env bash
# `bench sweep --ops mpi,bucketed-node,bucketed-mpi` from 4 KiB to 1 MiB on the emulated 2x3 and 2x4 clusters, two rounds
# (whether the measured crossover follows the ranks per node). Run from the repository root as
# `flock /tmp/mpisolve-cpu.lock perf/results/node_aware/leader/layouts.sh`; the log is layouts-<main's commit>.log here.
set -euo pipefail
HERE=perf/results/node_aware/leader
for r in 1 2; do
  for h in a:3,b:3 a:4,b:4; do
    n=$(( ${h:2:1} * 2 ))
    echo "== r$r $h $(date -u +%T) $(uptime | sed 's/.*load/load/')"
    .venv/bin/mpiexec -launcher ssh -launcher-exec "$PWD/tests/cluster/fake-ssh" -hosts "$h" -n "$n" .venv/bin/python -m mpi4py \
      -m mpisolve bench sweep --min-bytes 4K --max-bytes 1M --ops mpi,bucketed-node,bucketed-mpi 2>&1 | grep -v "^{\|^MPICH" | cut -c1-200
  done
done | tee "$HERE/layouts-$(git rev-parse --short HEAD).log"
