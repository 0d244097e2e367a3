#!/bin/bash
cd /tmp
for round in 1 2 3; do
  for opt in "sgd on" "nesterov-foreach on" "nesterov-foreach off"; do
    set -- $opt
    flock /tmp/mpisolve-cpu.lock /work/wt29/.venv/bin/mpiexec -n 2 /work/wt29/.venv/bin/python -m mpi4py -m mpisolve bench step --model resnet18 --batch 8 --repeats 10 --warmup 3 --optimizer $1 --node-shm $2 2>/dev/null | grep '^{' | sed "s/^{/{\"round\": $round, /"
  done
done
