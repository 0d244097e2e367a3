#!/usr/bin/env bash
# Scaling study (write-up: docs/studies/scaling.md): weak scaling (32 samples per rank per step) at 1, 2, 4, 8 ranks on
# digits, throughput, efficiency, busy/comm/idle, in two labelled series:
# - real compute (ranks share the cores): every registered solver, MLP (120 micro-batches per rank) and CNN (200):
#   half a second or more a run at 4 and 8 ranks, hundreds of the shared cores' time slices (24 left the CNN's
#   runs a tenth of a second, at the scheduler's mercy);
# - an emulated device per rank (--device-ms): the MLP, where communication matters, one
#   solver of each kind (16 micro-batches per rank: sleep-paced, so steady).
# -> OUT, default perf/results/scaling/ (scaling.csv, table.md, scaling_<model>[_emulated].png, device.json, one
#    directory per run). A study's repeats run this script with OUT set, so they run the study's own commands.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-perf/results/scaling}
"${PYTHON:-python}" perf/scaling.py --models mlp --ranks 1 2 4 8 --series real --batches 120 --log-every 12 --out "$OUT"
# abs-sgd's CNN rounds are long (many micro-batches at 8 ranks): a record every 5 rounds, so a run has several.
"${PYTHON:-python}" perf/scaling.py --models cnn --ranks 1 2 4 8 --series real --batches 200 --log-every 20 \
    --solvers allreduce,adasum,lb-bsp,local-sgd,kfac,easgd,async-sgd,async-msgd,hogwild-sgd,async-easgd,async-measgd,ea-wild --out "$OUT"
"${PYTHON:-python}" perf/scaling.py --models cnn --ranks 1 2 4 8 --series real --batches 200 --log-every 5 --solvers abs-sgd --out "$OUT"
"${PYTHON:-python}" perf/scaling.py --models mlp --ranks 1 2 4 8 --series emulated --batches 16 --log-every 2 \
    --solvers allreduce,adasum,easgd,local-sgd,async-easgd,ea-wild,hogwild-sgd --out "$OUT"
