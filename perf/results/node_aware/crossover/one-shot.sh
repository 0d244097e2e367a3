#!/usr/bin/env bash
# `bench sweep --ops mpi,sum` (mpisolve.allreduce of one tensor) from 256 KiB to 4 MiB on the emulated 2x2 and 2x3
# clusters, with the default crossovers (one message below 4 MiB) and with MPISOLVE_NODE_SHM_MIN_BYTES=1048576
# (node-shared from 1 MiB), two rounds; prints "<hosts> <bytes> <setting> <sum over MPICH>" (one-shot.txt: the run of
# 29 Nov 13:20-13:22 UTC at ea09622). Run from the repository root.
set -euo pipefail
for r in 1 2; do for env in "" "MPISOLVE_NODE_SHM_MIN_BYTES=1048576"; do for hl in "a:2,b:2 4" "a:3,b:3 6"; do set -- $hl
  flock /tmp/mpisolve-cpu.lock env $env .venv/bin/mpiexec -launcher ssh -launcher-exec "$PWD/tests/cluster/fake-ssh" \
    -hosts "$1" -n "$2" .venv/bin/python -m mpi4py -m mpisolve bench sweep --ops mpi,sum --min-bytes 256K \
    --max-bytes 4M --factor 2 --repeats 20 2>&1 >/dev/null | grep -E "^ +[0-9]" \
    | awk -v e="${env:-default}" -v l="$1" '{printf "%s %s %s %s\n", l, $1, e, $2}'
done; done; done | sort -k1,1 -k2,2n -k3,3
