#!/usr/bin/env bash
# Horovod's own PyTorch tests against mpisolve.horovod (issue 32; docs/studies/horovod-suite.md).
#
#   perf/horovod_suite.sh HOROVOD_TREE          (or HOROVOD_SRC=PATH)
#
# HOROVOD_TREE is a horovod/horovod source tree (fetched by the user; nothing from it is
# copied here). Its test/parallel/test_torch.py and test_adasum_pytorch.py run unchanged,
# through the stand-in package perf/horovod_standin, whose `horovod.torch` is
# mpisolve.horovod, at each of SIZES ranks on the CPU:
#   - each test in its own mpiexec run (a test that fails on some ranks only leaves the
#     others inside a collective that no later test matches: alone, one failure stays one);
#   - both files in one run per size, as Horovod's CI ran them (what leaks between tests);
#   - the tests that loop over every torch.optim class once more without torch.optim.Muon
#     (perf/horovod_standin/no_muon.py: Muon, newer than Horovod, refuses their 1-D biases).
# Every run holds the CPU lock (LOCK) while it runs, and is bounded (pytest-timeout per
# test, MPISOLVE_TIMEOUT per wait, `timeout` per mpiexec). test/utils/common.py imports
# `mock`: installed into this Python if missing. Results: OUT/n<N>/*.xml (JUnit, one per
# rank and run) and OUT/summary.md (perf/horovod_suite.py report).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

PY=${PY:-$ROOT/.venv/bin/python}
MPIEXEC=${MPIEXEC:-$ROOT/.venv/bin/mpiexec}
LOCK=${LOCK:-/tmp/mpisolve-cpu.lock}
OUT=${OUT:-$ROOT/perf/results/horovod_suite}
SIZES=${SIZES:-"2 3"}
ONLY=${ONLY:-.}
SRC=${1:-${HOROVOD_SRC:-}}
[[ -n $SRC && -f $SRC/test/parallel/test_torch.py ]] || {
    echo "usage: $0 HOROVOD_TREE (a horovod/horovod source tree with test/parallel/test_torch.py)" >&2
    exit 2
}
SRC=$(cd "$SRC" && pwd)
"$PY" -c "import mock" 2>/dev/null || "$PY" -m pip install --quiet mock
export PYTHONPATH=$ROOT/perf/horovod_standin
export MPISOLVE_TIMEOUT=${MPISOLVE_TIMEOUT:-120}
FILES="test_torch.py test_adasum_pytorch.py"
cd "$SRC/test/parallel"

run() {  # run N XML-PREFIX PYTEST-ARGS...: one bounded mpiexec under the lock; each rank writes its JUnit XML
    local n=$1 prefix=$2
    shift 2
    flock "$LOCK" timeout 900 "$MPIEXEC" -n "$n" bash -c 'exec "$0" -m mpi4py -m pytest -p no:cacheprovider -q \
        --timeout=300 --timeout-method=thread --junitxml="$1-$PMI_RANK.xml" "${@:2}"' "$PY" "$prefix" "$@" \
        > "$prefix.log" 2>&1 || true
}

ids=$("$PY" -m pytest -p no:cacheprovider --collect-only -q $FILES 2>/dev/null | grep '::' | grep -E "$ONLY")
for n in $SIZES; do
    dir=$OUT/n$n
    mkdir -p "$dir"
    rm -f "$dir"/*.xml "$dir"/*.log
    { date -u +%FT%TZ; git -C "$ROOT" rev-parse --short HEAD; uptime; } > "$dir/run.txt"
    for id in $ids; do
        echo "== $n ranks: $id" >&2
        run "$n" "$dir/alone.${id##*::}" "$id"
    done
    echo "== $n ranks: both files in one run" >&2
    run "$n" "$dir/whole" $FILES
    echo "== $n ranks: the optimizer loops without Muon" >&2
    run "$n" "$dir/no-muon" -p no_muon -k "test_broadcast_state or test_force_allreduce" test_torch.py
done
cd "$ROOT"
"$PY" perf/horovod_suite.py report "$OUT" | tee "$OUT/summary.md"
