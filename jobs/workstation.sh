#!/usr/bin/env bash
# mpisolve on one machine without a scheduler: NP ranks (default 4) under mpiexec.
#   jobs/workstation.sh --solver allreduce --model mlp --dataset digits --epochs 3 --log runs/mlp.jsonl
#   NP=8 jobs/workstation.sh --solver adasum ...
#   MPISOLVE_RUN="-m mpisolve bench sweep" NP=2 jobs/workstation.sh --csv runs/sweep.csv
# Open MPI's mpirun as root also needs OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z ${VIRTUAL_ENV:-} && -f $repo/.venv/bin/activate ]]; then
    source "$repo/.venv/bin/activate"     # the checkout's venv (mpiexec comes with the MPICH wheel)
fi
read -r -a program <<< "${MPISOLVE_RUN:--m mpisolve train}"
# Without OMP_NUM_THREADS, mpisolve.init() gives each rank cores / NP torch threads.
exec "${MPIEXEC:-mpiexec}" -n "${NP:-4}" "${PYTHON:-python}" -m mpi4py "${program[@]}" "$@"
