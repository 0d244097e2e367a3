#!/usr/bin/env bash
# MPICH's choice of algorithm for its nonblocking (and persistent) allreduce, MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM, set
# for the whole job: `bench sweep --ops mpi,bucketed,bucketed-node,bucketed-mpi,average`, 4 KiB to 16 MiB, at 4 ranks on
# one node and on the emulated 2x2 and 2x3 clusters, MPICH's default ("auto") against $ALGORITHMS in turn, $ROUNDS rounds.
# Run from the repository root as
# `ALGORITHMS="sched_recursive_doubling" ROUNDS=2 flock /tmp/mpisolve-cpu.lock perf/results/node_aware/leader/mpich-cvar.sh`;
# the log is mpich-cvar-<main's commit>-<the algorithms>.log here.
set -euo pipefail
HERE=perf/results/node_aware/leader
SSH=(-launcher ssh -launcher-exec "$PWD/tests/cluster/fake-ssh")
for round in $(seq "$ROUNDS"); do
  for layout in n4 2x2 2x3; do
    for algorithm in auto $ALGORITHMS; do
      echo "== r$round $layout $algorithm $(date -u +%T) $(uptime | sed 's/.*load/load/')"
      case $layout in
        n4) where=(-n 4) ;;
        2x2) where=("${SSH[@]}" -hosts a:2,b:2 -n 4) ;;
        2x3) where=("${SSH[@]}" -hosts a:3,b:3 -n 6) ;;
      esac
      .venv/bin/mpiexec "${where[@]}" -env MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM "$algorithm" .venv/bin/python -m mpi4py \
        -m mpisolve bench sweep --min-bytes 4K --max-bytes 16M --ops mpi,bucketed,bucketed-node,bucketed-mpi,average 2>&1 |
        grep -v "^{\|^MPICH" | grep -v "^$" | cut -c1-200
    done
  done
done | tee "$HERE/mpich-cvar-$(git rev-parse --short HEAD)-${ALGORITHMS// /-}.log"
