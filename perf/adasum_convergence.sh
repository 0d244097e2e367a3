#!/usr/bin/env bash
# Adasum convergence study (issue 4, item 6): does Adasum reach the target accuracy in
# fewer epochs than averaging at the learning rate tuned for one worker's batch?
# Write-up, figures and provenance: docs/studies/adasum-convergence.md
#
#   perf/adasum_convergence.sh [PIECE ...]     (default: all pieces in order)
#
# Pieces, each run under the CPU lock on its own so no hold is long:
#   tune      1 rank, batch B: the learning-rate grid; the best final accuracy after
#             TUNE_EPOCHS epochs is "the single-worker lr" (written to tune/lr.txt)
#   same-lr   RANKS ranks, batch B each: compare allreduce (average) and adasum
#             (delta mode) at the single-worker lr
#   gradient  the same with adasum mode=gradient
#   scaled    allreduce at RANKS x the single-worker lr (linear scaling: the retuned average)
#   report    results.csv/results.json and the plots of all four runs (no MPI, no lock)
# Results go to perf/results/adasum_convergence/ (override with OUT=...). A replication
# with another seed at the same learning rate: SEED=1 LR=<tune/lr.txt> OUT=.../seed1
# perf/adasum_convergence.sh same-lr gradient scaled report.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
MPIEXEC=${MPIEXEC:-.venv/bin/mpiexec}
LOCK=${LOCK:-/tmp/mpisolve-cpu.lock}
OUT=${OUT:-perf/results/adasum_convergence}
RANKS=${RANKS:-4}
BATCH=${BATCH:-64}                   # per-rank micro-batch; the global batch is RANKS x BATCH
TUNE_LRS=${TUNE_LRS:-"0.0125 0.025 0.05 0.1 0.2"}
TUNE_EPOCHS=${TUNE_EPOCHS:-2}
EPOCHS=${EPOCHS:-8}
TARGET=${TARGET:-0.65}
SEED=${SEED:-0}
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-600}
WORKLOAD=(--model cnn --dataset synthetic --data-size 4000 --batch-size "$BATCH" --momentum 0.9
          --seed "$SEED" --target-accuracy "$TARGET" --eval-every 0.25)

locked() { flock "$LOCK" timeout 900 "$@"; }
compare() { locked "$MPIEXEC" -n "$RANKS" "$PY" -m mpi4py -m mpisolve compare "${WORKLOAD[@]}" --epochs "$EPOCHS" "$@"; }
single_lr() {
    if [[ -n ${LR:-} ]]; then echo "$LR"; return; fi
    [[ -f $OUT/tune/lr.txt ]] || { echo "run the 'tune' piece first (or give LR=...)" >&2; exit 2; }
    cat "$OUT/tune/lr.txt"
}

tune() {
    mkdir -p "$OUT/tune"
    local lr
    locked bash -c "set -e; for lr in $TUNE_LRS; do
        $PY -m mpi4py -m mpisolve train ${WORKLOAD[*]} --epochs $TUNE_EPOCHS --lr \$lr --log $OUT/tune/lr_\$lr.jsonl >/dev/null
    done"
    lr=$("$PY" - "$OUT/tune" $TUNE_LRS <<'PY'
import json, sys
out, lrs = sys.argv[1], sys.argv[2:]
rows = []
for lr in lrs:
    s = json.load(open(f"{out}/lr_{lr}.summary.json"))
    rows.append((lr, s["final_accuracy"], s["epochs_to_target"], s["wall_s"]))
with open(f"{out}/tune.csv", "w") as f:
    f.write("lr,final_accuracy,epochs_to_target,wall_s\n")
    f.writelines(f"{lr},{acc:.4f},{'' if e is None else f'{e:.2f}'},{w:.2f}\n" for lr, acc, e, w in rows)
print(max(rows, key=lambda r: r[1])[0])
PY
)
    echo "$lr" >"$OUT/tune/lr.txt"
    cat "$OUT/tune/tune.csv"
    echo "single-worker lr (best final accuracy after $TUNE_EPOCHS epochs at batch $BATCH): $lr"
}

same_lr() { compare --solvers allreduce,adasum --lr "$(single_lr)" --out "$OUT/same_lr"; }
gradient() { compare --solvers adasum --set mode=gradient --lr "$(single_lr)" --out "$OUT/gradient"; }
scaled() {
    local lr
    lr=$("$PY" -c "print(round($RANKS * $(single_lr), 10))")
    compare --solvers allreduce --lr "$lr" --out "$OUT/scaled_lr"
}

report() {
    mkdir -p "$OUT/curves"
    local lr
    lr=$(single_lr)
    cp "$OUT/same_lr/allreduce.jsonl" "$OUT/curves/average_lr$lr.jsonl"
    cp "$OUT/same_lr/adasum.jsonl" "$OUT/curves/adasum_delta_lr$lr.jsonl"
    cp "$OUT/gradient/adasum.jsonl" "$OUT/curves/adasum_gradient_lr$lr.jsonl"
    cp "$OUT/scaled_lr/allreduce.jsonl" "$OUT/curves/average_lr$("$PY" -c "print(round($RANKS * $lr, 10))").jsonl"
    "$PY" -m mpisolve plot "$OUT"/curves/*.jsonl --out "$OUT"
    "$PY" - "$OUT" <<'PY'
import csv, json, sys
out = sys.argv[1]
runs = [("average", "same_lr/allreduce"), ("adasum delta", "same_lr/adasum"),
        ("adasum gradient", "gradient/adasum"), ("average, scaled lr", "scaled_lr/allreduce")]
fields = ("lr", "global_batch", "epochs_to_target", "time_to_target_s", "final_accuracy", "epochs", "wall_s", "samples_per_s")
rows = []
for label, path in runs:
    s = json.load(open(f"{out}/{path}.summary.json"))
    w = s["workload"]
    rows.append({"run": label, "solver": s["solver"], "options": s["options"], "ranks": s["ranks"],
                 "lr": w["lr"], "global_batch": s["ranks"] * w["batch_size"], "target_accuracy": s["target_accuracy"],
                 **{k: s[k] for k in fields if k in s}, "git_commit": s["git_commit"]})
json.dump({"workload": s["workload"] | {"lr": None}, "runs": rows}, open(f"{out}/results.json", "w"), indent=1)
cols = ("run", "ranks", "lr", "global_batch", "target_accuracy", "epochs_to_target", "time_to_target_s",
        "final_accuracy", "epochs", "wall_s", "samples_per_s")
fmt = lambda v: "" if v is None else (f"{v:.4g}" if isinstance(v, float) else v)
with open(f"{out}/results.csv", "w", newline="") as f:
    csv.writer(f).writerows([cols, *([fmt(r[c]) for c in cols] for r in rows)])
print(open(f"{out}/results.csv").read(), end="")
PY
}

pieces=("$@")
[[ ${#pieces[@]} -gt 0 ]] || pieces=(tune same-lr gradient scaled report)
for piece in "${pieces[@]}"; do
    case $piece in
        tune | same-lr | gradient | scaled | report) echo "== $piece" >&2; "${piece//-/_}" ;;
        *) echo "unknown piece '$piece' (tune, same-lr, gradient, scaled, report)" >&2; exit 2 ;;
    esac
done
