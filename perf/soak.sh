#!/bin/sh
# Soak: every asynchronous solver for 2,000 steps at 4 ranks; RSS after warm-up and at the
# end, and the MPI windows left open after close() (must be 0). Prints one JSON object.
# Run under the CPU lock on a shared machine:  flock /tmp/mpisolve-cpu.lock perf/soak.sh
set -e
cd "$(dirname "$0")/.."
NP=${NP:-4}
STEPS=${STEPS:-2000}
MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-1800} exec .venv/bin/mpiexec -n "$NP" .venv/bin/python -m mpi4py -m mpisolve \
	bench soak --steps "$STEPS" --warmup-steps 200 "$@"
