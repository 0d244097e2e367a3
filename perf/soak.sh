#!/bin/sh
# Soak: each asynchronous solver (or those named) for 2,000 steps at 4 ranks, one mpiexec
# each; prints one JSON object per solver (bench soak): every rank's RSS after 200 steps and
# at the end, and the MPI windows left open after close() (must be 0).
# Write-up and figures: docs/studies/soak.md
# On a shared machine, PERF_LOCK=/tmp/mpisolve-cpu.lock holds the CPU lock per solver.
set -e
cd "$(dirname "$0")/.."
NP=${NP:-4}
STEPS=${STEPS:-2000}
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-1800}
SOLVERS=${*:-$(.venv/bin/python -c "from mpisolve.solvers.base import solver_class; import mpisolve; print(' '.join(n for n in mpisolve.solver_names() if not solver_class(n).lockstep))")}
for solver in $SOLVERS; do
	${PERF_LOCK:+flock $PERF_LOCK} .venv/bin/mpiexec -n "$NP" .venv/bin/python -m mpi4py -m mpisolve bench soak --solvers "$solver" \
		--steps "$STEPS" --warmup-steps 200
done
