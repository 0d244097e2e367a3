#!/usr/bin/env bash
# Three repeats of perf/scaling.sh's four commands, each into its own directory, under the CPU lock.
# Run at 8604011 from /work/main as `flock /tmp/mpisolve-cpu.lock study.sh`; each /tmp/quiet-8604011/r<k> was then copied to repeat-<k> (scaling.csv, table.md, device.json, the figures).
set -euo pipefail
cd /work/main
P=.venv/bin/python
for k in 1 2 3; do
  out=/tmp/quiet-8604011/r$k
  echo "repeat $k start $(date -u +%H:%M:%S) $(uptime)"
  $P perf/scaling.py --models mlp --ranks 1 2 4 8 --series real --out $out
  $P perf/scaling.py --models cnn --ranks 1 2 4 8 --series real --batches 24 --log-every 3 \
    --solvers allreduce,adasum,lb-bsp,local-sgd,kfac,easgd,async-sgd,async-msgd,hogwild-sgd,async-easgd,async-measgd,ea-wild --out $out
  $P perf/scaling.py --models cnn --ranks 1 2 4 8 --series real --batches 24 --log-every 1 --solvers abs-sgd --out $out
  $P perf/scaling.py --models mlp --ranks 1 2 4 8 --series emulated --batches 16 --log-every 2 \
    --solvers allreduce,adasum,easgd,local-sgd,async-easgd,ea-wild,hogwild-sgd --out $out
  echo "repeat $k end $(date -u +%H:%M:%S) $(uptime)"
done
