#!/usr/bin/env bash
# The GPU checks of docs/guide/gpus.md in one run, on a machine with one NVIDIA GPU, from the
# repository root with mpisolve installed (its gpu extra, or the machine's own CuPy and
# numba-cuda) and MPICH's mpiexec beside $PYTHON. Each step has its own time limit, a failing
# step does not stop the next, and the run ends with one line per step.
#
#   PYTHON=.venv/bin/python bash perf/gpu/check.sh [OUT]
#
# Write-up and figures: docs/studies/gpu.md
# OUT (default perf/results/gpu) receives check.log (everything printed) and results.jsonl
# (every bench's JSON line, tagged with its step). DEVICE=cpu runs the same steps on the CPU
# (a dry run of the script itself; the gpu-marked tests then skip), MODEL=mlp a smaller model
# than ResNet-18.
set -u
PYTHON=${PYTHON:-python3}
MPIEXEC=${MPIEXEC:-$(dirname "$(command -v "$PYTHON")")/mpiexec}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-resnet18}
OUT=${1:-perf/results/gpu}
mkdir -p "$OUT"
LOG=$OUT/check.log
RESULTS=$OUT/results.jsonl
: >"$LOG"
: >"$RESULTS"
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-300} PYTHONUNBUFFERED=1
SUMMARY=()

# step NAME SECONDS COMMAND...: run it under a time limit; its output to the log, its JSON lines to results.
step() {
    local name=$1 limit=$2 start rc
    shift 2
    echo "== $name: $*" | tee -a "$LOG"
    start=$(date +%s)
    if declare -F "$1" >/dev/null; then "$@"; else timeout -k 10 "$limit" "$@"; fi 2>&1 | tee "$OUT/.step" >>"$LOG"
    rc=${PIPESTATUS[0]}
    grep '^{"' "$OUT/.step" | "$PYTHON" -c '
import json, sys
for line in sys.stdin:
    try:
        print(json.dumps({"step": sys.argv[1], **json.loads(line)}))
    except ValueError:
        pass' "$name" >>"$RESULTS"
    rm -f "$OUT/.step"
    SUMMARY+=("$name rc=$rc $(($(date +%s) - start))s")
    echo "== $name: rc=$rc in $(($(date +%s) - start)) s" | tee -a "$LOG"
}

PYTEST=(-m pytest -q -p no:cacheprovider --timeout=240 --timeout-method=thread)
MPI2=("$MPIEXEC" -n 2 "$PYTHON" -m mpi4py)

environment() {  # each command under its own limit (a step that is a function runs without one)
    timeout 30 nvidia-smi || true
    timeout 60 "$PYTHON" -c 'import torch, mpi4py, numba, mpisolve; from mpi4py import MPI
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())
print("numba", numba.__version__, "mpi4py", mpi4py.__version__, MPI.Get_library_version().splitlines()[0])
print("mpisolve", mpisolve.__version__)'
    timeout 60 "${MPI2[@]}" -c 'import mpisolve; c = mpisolve.init(); print(c.rank, c.device, c.cuda_aware, c.cuda_aware_source)'
}
step environment 120 environment

# Issue 18's two goals first: the allreduce solver's own overhead at one rank (solver_over_plain),
# and the staged bucket allreduce against gloo on the same CUDA tensors at two ranks.
step overhead-1rank 180 "$PYTHON" -m mpisolve bench step --solver allreduce --model "$MODEL" --batch 32 \
    --device "$DEVICE" --repeats 30 --warmup 5
step allreduce-vs-gloo-2ranks 180 env MPISOLVE_CUDA_AWARE=0 "${MPI2[@]}" -m mpisolve bench allreduce \
    --model "$MODEL" --device "$DEVICE" --repeats 20 --warmup 3

# The tests: the gpu-marked ones (serial, then two ranks sharing the GPU) and the kernels'
# tests, which run their numba.cuda kernels on the device when one is present.
step tests-gpu 120 "$PYTHON" "${PYTEST[@]}" -m "gpu and not mpi" tests
step tests-gpu-2ranks 150 "${MPI2[@]}" "${PYTEST[@]}" --with-mpi -m "mpi and gpu" tests
step tests-kernels 150 "$PYTHON" "${PYTEST[@]}" -m "not mpi" tests/kernels

# Every solver's step with two ranks sharing the GPU, then on one GPU alone.
SOLVERS=(-m perf.gpu.every_solver --model "$MODEL" --device "$DEVICE" --repeats 5 --warmup 2)
step every-solver-2ranks 150 "${MPI2[@]}" "${SOLVERS[@]}"
step every-solver-1rank 150 "$PYTHON" -m mpi4py "${SOLVERS[@]}"

# The benches on device tensors.
step bench-adasum 90 "${MPI2[@]}" -m mpisolve bench adasum --model "$MODEL" --device "$DEVICE" --repeats 10
step bench-kfac 90 "${MPI2[@]}" -m mpisolve bench kfac --model mlp --device "$DEVICE" --repeats 5
step bench-kernels 90 "$PYTHON" -m mpisolve bench kernels --device "$DEVICE" --repeats 10

printf '%s\n' "${SUMMARY[@]}" | tee -a "$LOG"
