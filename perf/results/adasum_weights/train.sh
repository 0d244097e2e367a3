#!/usr/bin/env bash
# Adasum at rank counts that are not a power of two, before (BASE: a checkout of 8156146, the plain
# rule at every pair) and after (this checkout, 3a30d0d on: uneven pairs weighed by their ranks):
# `mpisolve train --solver adasum` on digits (MLP), seeds 1-4, at 3 and 5 ranks, alternating per
# seed; one summary line per run (final test accuracy and loss). Run from the repository root:
#   BASE=/tmp/s41-base bash perf/results/adasum_weights/train.sh > perf/results/adasum_weights/train-<date>.txt
set -u
ROOT=$PWD
BASE=${BASE:?a checkout of 8156146 with mpisolve/kernels linked to ../kernels}
EPOCHS=${EPOCHS:-8}
for n in 3 5; do
  for seed in 1 2 3 4; do
    for side in before after; do
      tree=$ROOT; [ "$side" = before ] && tree=$BASE
      line=$(cd /tmp && PYTHONPATH=$tree timeout 600 "$ROOT/.venv/bin/mpiexec" -n $n "$ROOT/.venv/bin/python" -m mpi4py \
        -m mpisolve train --solver adasum --model mlp --dataset digits --epochs "$EPOCHS" --seed $seed 2>/dev/null | tail -1)
      echo "$line" | "$ROOT/.venv/bin/python" -c "
import json, sys
r = json.loads(sys.stdin.read())
print(f'ranks $n seed $seed $side: final_accuracy {r[\"final_accuracy\"]:.4f} final_test_loss {r[\"final_test_loss\"]:.4f} commit {r[\"git_commit\"][:7]}')"
    done
  done
done
