#!/usr/bin/env bash
# abs-sgd on the CNN at N ranks, option variants, steady iteration and busy/comm/idle (as perf/scaling.py's steady).
cd /work/main
N=${N:-4}; EP=$(python3 -c "print(24*32*$N/1437)")
for k in ${ROUNDS:-1 2}; do
for v in ${VARIANTS:-default fixed nopred none}; do
  case $v in default) S="";; fixed) S="--set abs-sgd.micro_batch=fixed";; speed) S="--set abs-sgd.micro_batch=speed";; nopred) S="--set abs-sgd.weight_prediction=0";; none) S="--set abs-sgd.progress=none";; nocorr) S="--set abs-sgd.momentum_correction=false";; allreduce) S="";; esac
  solver=abs-sgd; [ $v = allreduce ] && solver=allreduce
  out=/tmp/absprobe/n$N-$v-$k; rm -rf $out
  OMP_NUM_THREADS=1 .venv/bin/mpiexec -n $N .venv/bin/python -m mpi4py -m mpisolve compare --solvers $solver --model cnn --dataset digits --batch-size 32 --momentum 0 --epochs $EP --log-every 1 --eval-every 1000 --out $out $S > $out.log 2>&1 || echo FAIL $v
  .venv/bin/python - $out/$solver.jsonl $v "$(uptime)" <<'PY'
import json,sys
sys.path.insert(0,"perf")
from pathlib import Path
from scaling import steady
s=steady(Path(sys.argv[1]))
it=32*int(__import__("os").environ.get("N","4"))/s["samples_per_s"]*1e3
print(f"{sys.argv[2]:10s} it {it:6.2f} ms busy {it*s['busy']:5.2f} comm {it*s['comm']:5.2f} idle {it*s['idle']:5.2f}  {sys.argv[3][-17:]}")
PY
done; done
