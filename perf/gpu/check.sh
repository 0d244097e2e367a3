#!/usr/bin/env bash
# The GPU checks of docs/guide/gpus.md in one run, on a machine with one NVIDIA GPU, from the
# repository root with mpisolve installed (its gpu extra, or the machine's own CuPy and
# numba-cuda) and MPICH's mpiexec beside $PYTHON. Steps run in priority order (the first ones
# are issue 31's: the sync check, every solver's one-rank cost, the engines); each has its own time limit, a failing
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

# Run from the repository root, the checkout's mpisolve/ shadows the installed package, which has
# mpisolve.kernels (kernels/ installs there): the same layout here (the link is git-ignored).
"$PYTHON" -c "import mpisolve.kernels" 2>/dev/null || ln -sfn ../kernels mpisolve/kernels

environment() {  # each command under its own limit (a step that is a function runs without one)
    timeout 30 nvidia-smi || true
    timeout 60 "$PYTHON" -c 'import torch, mpi4py, numba, mpisolve; from mpi4py import MPI
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())
print("numba", numba.__version__, "mpi4py", mpi4py.__version__, MPI.Get_library_version().splitlines()[0])
print("mpisolve", mpisolve.__version__)'
    timeout 60 "${MPI2[@]}" -c 'import mpisolve; c = mpisolve.init(); print(c.rank, c.device, c.cuda_aware, c.cuda_aware_source)'
}
step environment 120 environment

# Issue 31's checks first. Every solver's step under torch's sync debug mode, one rank ("error":
# anything but mpisolve's one read of a step raises); ordinary, factor and inversion steps of K-FAC apart.
step sync-check-1rank 120 "$PYTHON" -m mpi4py -m perf.gpu.sync_check --model "$MODEL" --mode error

# Every solver's step against plain PyTorch at one rank (30 repeats, medians), then K-FAC's factor
# and inversion steps timed apart (every step one of them).
SOLVERS=(-m perf.gpu.every_solver --model "$MODEL" --device "$DEVICE" --repeats 30 --warmup 5)
step every-solver-1rank 150 "$PYTHON" -m mpi4py "${SOLVERS[@]}"
KFAC=(-m mpisolve bench step --solver kfac --model "$MODEL" --device "$DEVICE" --set factor_update_steps=1)
step kfac-factor-steps-1rank 45 "$PYTHON" "${KFAC[@]}" --repeats 15 --warmup 3
step kfac-inversion-steps-1rank 60 "$PYTHON" "${KFAC[@]}" --set inv_update_steps=1 --repeats 8 --warmup 2

# The tests: the gpu-marked ones, serial (NCCL at one rank among them), then two ranks sharing the
# GPU (every solver staged through MPI and through the gloo engine on CUDA tensors).
step tests-gpu 90 "$PYTHON" "${PYTEST[@]}" -m "gpu and not mpi" tests
step tests-gpu-2ranks 150 "${MPI2[@]}" "${PYTEST[@]}" --with-mpi -m "mpi and gpu" tests

# Two ranks sharing the GPU: the allreduce solver's step through MPI (staged) and through the gloo
# engine; then the sync check in "warn" mode (an error on one rank would strand the other).
step engine-2ranks-mpi 45 env MPISOLVE_ENGINE=mpi "${MPI2[@]}" -m mpisolve bench step --solver allreduce \
    --model "$MODEL" --device "$DEVICE" --repeats 20 --warmup 3
step engine-2ranks-gloo 45 env MPISOLVE_ENGINE=gloo "${MPI2[@]}" -m mpisolve bench step --solver allreduce \
    --model "$MODEL" --device "$DEVICE" --repeats 20 --warmup 3
step sync-check-2ranks 120 "${MPI2[@]}" -m perf.gpu.sync_check --model "$MODEL" --mode warn

# Lower priority: the kernels' tests on the device, every solver with two ranks sharing the GPU.
step tests-kernels 90 "$PYTHON" "${PYTEST[@]}" -m "not mpi" tests/kernels
step every-solver-2ranks 120 "${MPI2[@]}" -m perf.gpu.every_solver --model "$MODEL" --device "$DEVICE" --repeats 10 --warmup 2

printf '%s\n' "${SUMMARY[@]}" | tee -a "$LOG"
