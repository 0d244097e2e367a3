#!/usr/bin/env bash
# async-measgd on the CNN at N ranks on main: progress thread (default) vs none; steady iteration as perf/scaling.py reads it.
N=${N:-8}; EP=$(python3 -c "print(24*32*$N/1437)")
cd /work/main
for k in ${ROUNDS:-1 2}; do
for v in ${VARIANTS:-thread none}; do
  S=""; solver=${SOLVER:-async-measgd}
  case $v in none) S="--set $solver.progress=none";; esac
  out=/tmp/absprobe/mg-n$N-$v-$k; rm -rf $out
  OMP_NUM_THREADS=1 .venv/bin/mpiexec -n $N .venv/bin/python -m mpi4py -m mpisolve compare --solvers $solver --model cnn --dataset digits --batch-size 32 --momentum 0 --epochs $EP --log-every $((3*N)) --eval-every 1000 --out $out $S > $out.log 2>&1 || echo FAIL $v
  N=$N .venv/bin/python - $out/$solver.jsonl $v "$(uptime)" <<'PY'
import json,sys,os
sys.path.insert(0,"/work/main/perf")
from pathlib import Path
from scaling import steady
s=steady(Path(sys.argv[1]))
it=32*int(os.environ["N"])/s["samples_per_s"]*1e3
print(f"n{os.environ['N']} {sys.argv[2]:9s} it {it:6.2f} ms busy {it*s['busy']:5.2f} comm {it*s['comm']:5.2f} idle {it*s['idle']:5.2f}  load{sys.argv[3].split('load average')[1]}", flush=True)
PY
done; done
