# Site settings shared by every sbatch template in jobs/ (sourced, not run).
# Edit the lines marked SITE once for your cluster; environment variables set when you
# submit (sbatch passes your environment on) take precedence over the defaults here.

# SITE: modules. Load the MPI that mpi4py was built against (docs/guide/install.md) and
# the Python that holds mpisolve. Examples:
#   module load gcc/12 openmpi/4.1 python/3.11
#   module load PrgEnv-gnu cray-mpich cray-python            # HPE Cray EX
# module load ...

# SITE: the Python environment holding mpisolve. Default: the checkout's .venv, unless
# one is already active (sbatch carries VIRTUAL_ENV and PATH over from the submitting shell).
if [[ -z ${VIRTUAL_ENV:-} && -f $MPISOLVE_HOME/.venv/bin/activate ]]; then
    source "$MPISOLVE_HOME/.venv/bin/activate"
fi
# conda activate mpisolve                                     # or a conda environment

# SITE: torch threads per rank: the cores Slurm gave each task (#SBATCH --cpus-per-task).
# Without OMP_NUM_THREADS, mpisolve.init() splits the node's cores among its ranks.
if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$SLURM_CPUS_PER_TASK}
fi

# SITE: CPU binding: pin each rank to its own cores so ranks do not migrate.
#   srun: --cpu-bind=cores (needs TaskPlugin=task/affinity or task/cgroup at the site;
#         without it srun says "lacks support for cpu binding" and runs unbound).
#   MPICH's mpiexec (Hydra): -bind-to core:<cores per rank>
#   Open MPI's mpirun: --map-by slot:PE=<cores per rank> --bind-to core
export SRUN_FLAGS=${SRUN_FLAGS---cpu-bind=cores}
export MPIEXEC_FLAGS=${MPIEXEC_FLAGS--bind-to core:${OMP_NUM_THREADS:-1}}
# export MPIEXEC_FLAGS="--map-by slot:PE=${OMP_NUM_THREADS:-1} --bind-to core"   # Open MPI

# SITE: how ranks wait for MPI. "spin" when every rank has a core of its own (the
# default "auto" spins unless a node runs more ranks than it has cores).
# export MPISOLVE_WAIT=spin

# SITE: the network between nodes (multi-node jobs). The MPI usually picks the fastest
# by itself; pin it when it does not, or when a node has several adapters:
#   export UCX_NET_DEVICES=mlx5_0:1                   # Open MPI / MPICH over UCX, InfiniBand
#   export FI_PROVIDER=cxi                            # (Cray) MPICH over libfabric, Slingshot
#   export FI_PROVIDER=verbs                          # MPICH over libfabric, InfiniBand

# SITE: CUDA-aware MPI (GPU jobs), so MPI reads and writes GPU memory directly instead of
# mpisolve staging it through pinned host buffers. Only with an MPI built with CUDA
# support (docs/guide/gpus.md); set the one for yours:
#   module load craype-accel-nvidia80; export MPICH_GPU_SUPPORT_ENABLED=1   # HPE Cray MPICH (A100)
#   export MPIR_CVAR_ENABLE_GPU=1                     # MPICH 4+ built with CUDA
#   export OMPI_MCA_pml=ucx UCX_TLS=rc,sm,cuda_copy,cuda_ipc   # Open MPI + UCX
#   export MV2_USE_CUDA=1                             # MVAPICH2-GDR
# mpisolve detects the result (MPIX_Query_cuda_support and the variables above);
# MPISOLVE_CUDA_AWARE=1 or 0 overrides it, and 0 (staging) is always safe.
# export MPISOLVE_CUDA_AWARE=0
