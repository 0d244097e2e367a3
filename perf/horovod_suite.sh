#!/usr/bin/env bash
# Horovod's own PyTorch tests against mpisolve.horovod (issue 32; docs/studies/horovod-suite.md).
#
#   perf/horovod_suite.sh HOROVOD_TREE          (or HOROVOD_SRC=PATH)
#
# HOROVOD_TREE is a horovod/horovod source tree (fetched by the user; nothing from it is
# copied here). Its test/parallel/test_torch.py and test_adasum_pytorch.py run unchanged,
# through the stand-in package perf/horovod_standin, whose `horovod.torch` is
# mpisolve.horovod, at each of SIZES ranks on the CPU:
#   - to a result for every test on every rank: runs with -x, each starting after the
#     last one's first failure (a test that fails on some ranks only leaves the others in
#     a collective that no later test matches; restarted, one failure stays one);
#   - both files in one run per size, as Horovod's CI ran them (what leaks between tests);
#   - the tests that loop over every torch.optim class once more without torch.optim.Muon
#     (perf/horovod_standin/no_muon.py: Muon, newer than Horovod, refuses their 1-D biases).
# Every run holds the CPU lock (LOCK) while it runs, and is bounded (pytest-timeout per
# test, MPISOLVE_TIMEOUT per wait, `timeout` per mpiexec). test/utils/common.py imports
# `mock`: installed into this Python if missing. Results: OUT/n<N>/*.jsonl (each rank's
# outcomes per run, perf/horovod_standin/suite_log.py), OUT/n<N>/*.json (outcomes),
# OUT/summary.md (perf/horovod_suite.py), and OUT/examples.md: what Horovod's
# examples/pytorch use of hvd that mpisolve.horovod lacks.
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
for n in $SIZES; do
    mkdir -p "$OUT/n$n"
    { date -u +%FT%TZ; git rev-parse --short HEAD; uptime; } > "$OUT/n$n/run.txt"
    echo "== $n ranks" >&2
    "$PY" perf/horovod_suite.py run --tests "$SRC/test/parallel" --ranks "$n" --out "$OUT" --python "$PY" \
        --mpiexec "$MPIEXEC" --lock "$LOCK" --only "$ONLY"
done
"$PY" perf/horovod_suite.py report "$OUT" | tee "$OUT/summary.md"
"$PY" perf/horovod_suite.py examples "$SRC" | tee "$OUT/examples.md"
