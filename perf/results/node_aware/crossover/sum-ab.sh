#!/usr/bin/env bash
# `bench sweep --ops mpi,sum` (mpisolve.allreduce of one tensor) from 1 to 64 MiB on the emulated 2x2 and 2x3 clusters,
# A = /tmp/base_a7 (a git archive of a727c38, its mpisolve/kernels linked to its kernels/) against B = main's checkout,
# two rounds; prints "<copy> <hosts> <bytes> <sum over MPICH>" sorted by layout and size (sum-ab.txt: the run of
# 29 Nov 12:46-12:49 UTC, main at ee73198, whose library is 78aa2d8's). Run from the repository root.
set -euo pipefail
for r in 1 2; do for d in /tmp/base_a7 "$PWD"; do for hl in "a:2,b:2 4" "a:3,b:3 6"; do set -- $hl
  (cd "$d" && flock /tmp/mpisolve-cpu.lock "$OLDPWD/.venv/bin/mpiexec" -launcher ssh -launcher-exec "$OLDPWD/tests/cluster/fake-ssh" \
    -hosts "$1" -n "$2" -env PYTHONPATH "$d" "$OLDPWD/.venv/bin/python" -m mpi4py -m mpisolve bench sweep --ops mpi,sum \
    --min-bytes 1M --max-bytes 64M --factor 4 --repeats 10 2>&1 >/dev/null | grep -E "^ +[0-9]" \
    | awk -v d="$d" -v l="$1" '{printf "%s %s %s %s\n", d, l, $1, $2}')
done; done; done | sort -k2,2 -k3,3n -k1,1
