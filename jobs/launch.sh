#!/usr/bin/env bash
# Start one mpisolve run on every task of the current Slurm allocation.
#
# The templates in this directory call it after setting the site knobs (site.sh). It runs
#     <launcher> $PYTHON -m mpi4py $MPISOLVE_RUN "$@"
# MPISOLVE_RUN defaults to "-m mpisolve train", so the arguments are train's options:
#     --solver S --model M --dataset D --epochs E --log FILE --set key=value ...
#
# Environment (all optional):
#   MPISOLVE_LAUNCHER  srun (default), mpiexec or mpirun (the MPI's own launcher, started
#                      inside the allocation; it reads the node list from Slurm)
#   MPISOLVE_RUN       what `python -m mpi4py` runs: "-m mpisolve train" (default),
#                      "-m mpisolve bench sweep", or your own "script.py"
#   MPISOLVE_SRUN_MPI  srun's --mpi plugin. Default: from the MPI mpi4py uses, pmi2 for
#                      MPICH, Intel MPI and MVAPICH, pmix for Open MPI. Sites may need
#                      another (cray_shasta on HPE Cray EX): see `srun --mpi=list`.
#   SRUN_FLAGS         extra srun flags (CPU binding; site.sh sets the default)
#   MPIEXEC_FLAGS      extra mpiexec/mpirun flags (CPU binding; site.sh sets the default)
#   MPISOLVE_GPU_BIND  1: every rank sees only its own GPU (jobs/gpu-bind.sh)
#   PYTHON             the interpreter (default: python on PATH)
set -euo pipefail

jobs_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${PYTHON:-python}
launcher=${MPISOLVE_LAUNCHER:-srun}
read -r -a program <<< "${MPISOLVE_RUN:--m mpisolve train}"

if [[ $# -eq 0 && ${program[*]} == "-m mpisolve train" ]]; then
    echo "mpisolve job: no training options given; pass them after the script, e.g." >&2
    echo "  sbatch jobs/single-node-cpu.sbatch --solver allreduce --model mlp --dataset digits --epochs 3 --log runs/mlp.jsonl" >&2
    exit 2
fi
: "${SLURM_NTASKS:?mpisolve job: not inside a Slurm allocation (use jobs/workstation.sh on a workstation)}"

# The MPI library mpi4py was built against (read without initialising MPI).
mpi_vendor() {
    "$python" -c 'import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; print(MPI.get_vendor()[0])'
}

case $launcher in
    srun)
        if [[ -z ${MPISOLVE_SRUN_MPI:-} ]]; then
            # MPICH's PMI client speaks PMI2 (it rejects PMIx); Open MPI's speaks PMIx.
            [[ $(mpi_vendor) == "Open MPI" ]] && MPISOLVE_SRUN_MPI=pmix || MPISOLVE_SRUN_MPI=pmi2
        fi
        read -r -a flags <<< "${SRUN_FLAGS:-}"
        command=(srun --mpi="$MPISOLVE_SRUN_MPI" "${flags[@]}")
        ;;
    mpiexec | mpirun)
        # MPICH's Hydra and Open MPI's mpirun both take the hosts and slots from Slurm.
        read -r -a flags <<< "${MPIEXEC_FLAGS:-}"
        command=("$launcher" -n "$SLURM_NTASKS" "${flags[@]}")
        ;;
    *)
        echo "mpisolve job: MPISOLVE_LAUNCHER must be srun, mpiexec or mpirun, not '$launcher'" >&2
        exit 2
        ;;
esac
if [[ ${MPISOLVE_GPU_BIND:-0} == 1 ]]; then
    command+=("$jobs_dir/gpu-bind.sh")
fi

echo "mpisolve job: ${command[*]} $python -m mpi4py ${program[*]} $*" >&2
exec "${command[@]}" "$python" -m mpi4py "${program[@]}" "$@"
