#!/usr/bin/env bash
# abs-sgd on the CNN at N ranks: 06005c4 (before) against main (after), default options, and fixed micro-batches
# on main; the steady iteration as perf/scaling.py reads it. Run under the CPU lock.
N=${N:-4}; EP=$(python3 -c "print(24*32*$N/1437)")
for k in ${ROUNDS:-1 2}; do
for v in ${VARIANTS:-before after fixed}; do
  S=""; T=/work/main
  case $v in before) T=/tmp/wt-base;; fixed) S="--set abs-sgd.micro_batch=fixed";; esac
  out=/tmp/absprobe/ab2-n$N-$v-$k; rm -rf $out
  (cd $T && PYTHONPATH=$T OMP_NUM_THREADS=1 /work/main/.venv/bin/mpiexec -n $N /work/main/.venv/bin/python -m mpi4py -m mpisolve compare --solvers abs-sgd --model cnn --dataset digits --batch-size 32 --momentum 0 --epochs $EP --log-every 1 --eval-every 1000 --out $out $S > $out.log 2>&1) || echo FAIL $v
  N=$N /work/main/.venv/bin/python - $out/abs-sgd.jsonl $v "$(uptime)" <<'PY'
import json,sys,os
sys.path.insert(0,"/work/main/perf")
from pathlib import Path
from scaling import steady
s=steady(Path(sys.argv[1]))
it=32*int(os.environ["N"])/s["samples_per_s"]*1e3
print(f"n{os.environ['N']} {sys.argv[2]:8s} it {it:6.2f} ms busy {it*s['busy']:5.2f} comm {it*s['comm']:5.2f} idle {it*s['idle']:5.2f}  load{sys.argv[3].split('load average')[1]}", flush=True)
PY
done; done
