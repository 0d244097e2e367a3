#!/usr/bin/env bash
# Run "$@" seeing only this rank's GPU: the rank's node-local index picks one of the node's
# GPUs (from CUDA_VISIBLE_DEVICES when Slurm set it, else 0, 1, 2, ...), so rank k on a node
# uses GPU k and torch calls it cuda:0.
#
# The node-local index comes from the launcher: MPI_LOCALRANKID (MPICH's Hydra),
# OMPI_COMM_WORLD_LOCAL_RANK (Open MPI), SLURM_LOCALID (srun). SLURM_LOCALID is checked last:
# under mpiexec it is still set, to the batch script's own 0.
set -euo pipefail
local_rank=${MPI_LOCALRANKID:-${OMPI_COMM_WORLD_LOCAL_RANK:-${SLURM_LOCALID:-}}}
if [[ -z $local_rank ]]; then
    echo "gpu-bind.sh: no node-local rank in the environment (start it with srun, mpiexec or mpirun)" >&2
    exit 2
fi
if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    IFS=, read -r -a gpus <<< "$CUDA_VISIBLE_DEVICES"
    export CUDA_VISIBLE_DEVICES=${gpus[local_rank % ${#gpus[@]}]}
else
    export CUDA_VISIBLE_DEVICES=$local_rank
fi
exec "$@"
