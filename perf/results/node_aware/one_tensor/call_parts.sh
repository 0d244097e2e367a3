#!/usr/bin/env bash
# call_parts.py at 4 KiB (sum and average) on 2 and 4 ranks and on the emulated 2x2 and 2x3 clusters, with main's
# checkout. Run from the repository root as `flock /tmp/mpisolve-cpu.lock perf/results/node_aware/one_tensor/call_parts.sh`;
# the log (call-parts-<main's commit>.log) in this directory.
set -euo pipefail
HERE=$(pwd)/perf/results/node_aware/one_tensor
SSH=(-launcher ssh -launcher-exec "$(pwd)/tests/cluster/fake-ssh")
declare -A LAYOUTS=([n2]="-n 2" [n4]="-n 4" [2x2]="${SSH[*]} -hosts a:2,b:2 -n 4" [2x3]="${SSH[*]} -hosts a:3,b:3 -n 6")
{
  for layout in n2 n4 2x2 2x3; do
    for op in sum average; do
      read -ra where <<< "${LAYOUTS[$layout]}"
      parts=$(.venv/bin/mpiexec "${where[@]}" .venv/bin/python "$HERE/call_parts.py" 1024 "$op")
      echo "$layout $(date -u +%H:%M:%S) $(uptime | sed 's/.*load/load/') :: $parts"
    done
  done
} 2>&1 | grep -v "^MPICH: freeing" | tee "$HERE/call-parts-$(git rev-parse --short HEAD).log"
