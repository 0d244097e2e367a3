#!/usr/bin/env bash
# Throwaway probe kept as the record of what ran (29 Nov, 17:24 UTC, main 6fcbc48, under flock /tmp/mpisolve-cpu.lock):
# `mpisolve.allreduce` of one tensor (`bench sweep --ops mpi,sum`), 4-32 KiB, through node-shared memory (the default)
# and through one MPI message (MPISOLVE_NODE_SHM_MIN_BYTES past every size), two rounds; output in paths-4-32KiB.log.
cd /work/main
PY=/work/main/.venv/bin/python; MPIEXEC=/work/main/.venv/bin/mpiexec
SSH=(-launcher ssh -launcher-exec /work/main/tests/cluster/fake-ssh)
for round in 1 2; do
for layout in n2 n4 n8 2x2 2x3; do
  case $layout in n*) where=(-n "${layout#n}");; 2x2) where=("${SSH[@]}" -hosts a:2,b:2 -n 4);; 2x3) where=("${SSH[@]}" -hosts a:3,b:3 -n 6);; esac
  for v in node mpi; do
    env=(); [ $v = mpi ] && env=(-env MPISOLVE_NODE_SHM_MIN_BYTES 1073741824)
    echo "$round $layout $v $($MPIEXEC "${where[@]}" "${env[@]}" $PY -m mpi4py -m mpisolve bench sweep --ops mpi,sum --min-bytes 4K --max-bytes 32K --factor 2 --small-repeats 600 2>&1 >/dev/null | grep "^ *[0-9]" | awk '{printf "%s:%s ", $1, $2}')"
  done
done
done
