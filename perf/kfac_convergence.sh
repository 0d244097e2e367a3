#!/usr/bin/env bash
# K-FAC convergence study (issue 6, item 6): on the synthetic set with the small CNN, does
# K-FAC reach the target test accuracy in fewer epochs than SGD, and in less time?
# Write-up, figures and provenance: docs/studies/kfac-convergence.md
#
#   perf/kfac_convergence.sh
#
# Everything with MPI runs in one hold of the CPU lock (about 7 minutes at 4 ranks on 2 cores):
#   1. tune, on a seed of its own (TUNE_SEED): SGD's learning rate (best test accuracy after
#      TUNE_EPOCHS among LRS), then K-FAC's damping at that learning rate (among DAMPINGS);
#   2. for each of SEEDS, one `compare` of allreduce (plain SGD) and kfac (spd-kfac
#      preconditioning the same SGD: same lr, momentum, batch, data order, initial model);
#   3. without MPI: results.csv and results.json (per seed and solver: epochs and seconds to
#      TARGET, final accuracy, throughput; epochs to a few other accuracies; medians),
#      curves.csv (every evaluation) and the plots of the first seed's two runs.
# Results go to perf/results/kfac_convergence/ (override with OUT=...). The script takes the
# lock itself (LOCK=...); a caller already holding it sets KFAC_STUDY_LOCKED=1.
set -euo pipefail
cd "$(dirname "$0")/.."

LOCK=${LOCK:-/tmp/mpisolve-cpu.lock}
if [[ -z ${KFAC_STUDY_LOCKED:-} ]]; then
    exec env KFAC_STUDY_LOCKED=1 flock "$LOCK" timeout 1200 "$0" "$@"
fi

PY=${PY:-.venv/bin/python}
MPIEXEC=${MPIEXEC:-.venv/bin/mpiexec}
OUT=${OUT:-perf/results/kfac_convergence}
RANKS=${RANKS:-4}
SEEDS=${SEEDS:-"0 1 2"}
TUNE_SEED=${TUNE_SEED:-100}
TUNE_EPOCHS=${TUNE_EPOCHS:-2}
LRS=${LRS:-"0.025 0.05 0.1"}
DAMPINGS=${DAMPINGS:-"0.001 0.003 0.01"}
EPOCHS=${EPOCHS:-4}
TARGET=${TARGET:-0.65}
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-600}
WORKLOAD=(--model cnn --dataset synthetic --data-size 4000 --batch-size 32 --momentum 0.9 --eval-every 0.25
          --target-accuracy "$TARGET")
# K-FAC: factors every 5 steps, inverses every 25 (1 and a half times per epoch here); factor
# decay and KL clip at their defaults.
KFAC=(factor_update_steps=5 inv_update_steps=25)
mpisolve() { "$MPIEXEC" -n "$RANKS" "$PY" -m mpi4py -m mpisolve "$@"; }

# best_of PREFIX VALUES...: the value whose run PREFIX<value> ended with the best test accuracy.
best_of() {
    "$PY" - "$@" <<'PY'
import json, sys
prefix, values = sys.argv[1], sys.argv[2:]
accuracy = {v: json.load(open(f"{prefix}{v}.summary.json"))["final_accuracy"] for v in values}
for v in values:
    print(f"{prefix}{v}: test accuracy {accuracy[v]:.4f}", file=sys.stderr)
print(max(values, key=lambda v: (accuracy[v], -values.index(v))))
PY
}

mkdir -p "$OUT/tune"
echo "== tuning on seed $TUNE_SEED, $TUNE_EPOCHS epochs" >&2
for lr in $LRS; do
    mpisolve train --solver allreduce "${WORKLOAD[@]}" --seed "$TUNE_SEED" --epochs "$TUNE_EPOCHS" --lr "$lr" \
        --log "$OUT/tune/sgd_lr$lr.jsonl" >/dev/null
done
# shellcheck disable=SC2086
LR=$(best_of "$OUT/tune/sgd_lr" $LRS)
for damping in $DAMPINGS; do
    mpisolve train --solver kfac "${WORKLOAD[@]}" --seed "$TUNE_SEED" --epochs "$TUNE_EPOCHS" --lr "$LR" \
        "${KFAC[@]/#/--set=}" --set "damping=$damping" --log "$OUT/tune/kfac_damping$damping.jsonl" >/dev/null
done
# shellcheck disable=SC2086
DAMPING=$(best_of "$OUT/tune/kfac_damping" $DAMPINGS)
echo "{\"lr\": $LR, \"damping\": $DAMPING}" >"$OUT/tune/chosen.json"
echo "chosen: lr $LR, K-FAC damping $DAMPING" >&2

for seed in $SEEDS; do
    echo "== seed $seed" >&2
    mpisolve compare --solvers allreduce,kfac "${WORKLOAD[@]}" --seed "$seed" --epochs "$EPOCHS" --lr "$LR" \
        "${KFAC[@]/#/--set=kfac.}" --set "kfac.damping=$DAMPING" --out "$OUT/seed$seed"
done

"$PY" - "$OUT" <<'PY'
import csv, json, pathlib, statistics, sys

out = pathlib.Path(sys.argv[1])
ACCURACIES = (0.5, 0.6, 0.65, 0.7)
runs, curves = [], []
for summary_path in sorted(out.glob("seed*/summary.json")):
    seed = json.loads(summary_path.read_text())["workload"]["seed"]
    for solver in json.loads(summary_path.read_text())["solvers"]:
        run = json.loads((summary_path.parent / f"{solver}.summary.json").read_text())
        evaluations = [r for r in map(json.loads, (summary_path.parent / f"{solver}.jsonl").read_text().splitlines())
                       if r["test_accuracy"] is not None]
        runs.append({"seed": seed, "solver": solver, "ranks": run["ranks"], "target_accuracy": run["target_accuracy"],
                     "epochs_to_target": run["epochs_to_target"], "time_to_target_s": run["time_to_target_s"],
                     "final_accuracy": run["final_accuracy"], "epochs": run["epochs"], "wall_s": run["wall_s"],
                     "samples_per_s": run["samples_per_s"],
                     **{f"epochs_to_{a:g}": next((r["epoch"] for r in evaluations if r["test_accuracy"] >= a), None)
                        for a in ACCURACIES},
                     "options": run["options"], "git_commit": run["git_commit"]})
        curves += [{"seed": seed, "solver": solver, "epoch": r["epoch"], "wall_s": r["wall_s"],
                    "test_accuracy": r["test_accuracy"], "train_loss": r["loss"]} for r in evaluations]
medians = {}
for solver in dict.fromkeys(r["solver"] for r in runs):
    mine = [r for r in runs if r["solver"] == solver]
    reached = [r for r in mine if r["epochs_to_target"] is not None]
    medians[solver] = {
        "seeds": len(mine), "reached_target": len(reached),
        **{k: statistics.median(r[k] for r in reached) if reached else None for k in ("epochs_to_target", "time_to_target_s")},
        **{k: statistics.median(r[k] for r in mine) for k in ("final_accuracy", "wall_s", "samples_per_s")},
    }
first = json.loads(next(out.glob("seed*/summary.json")).read_text())
study = {"workload": first["workload"] | {"seed": None}, "chosen": json.loads((out / "tune/chosen.json").read_text()),
         "ranks": first["ranks"], "medians_over_seeds_that_reached_the_target": medians, "runs": runs}
(out / "results.json").write_text(json.dumps(study, indent=1) + "\n")
fmt = lambda v: "" if v is None else (f"{v:.4g}" if isinstance(v, float) else v)
for name, rows in (("results.csv", runs), ("curves.csv", curves)):
    columns = [c for c in rows[0] if c not in ("options", "git_commit")]
    with open(out / name, "w", newline="") as f:
        csv.writer(f).writerows([columns, *([fmt(r[c]) for c in columns] for r in rows)])
print((out / "results.csv").read_text(), end="")
print(json.dumps(medians, indent=1))
PY
first=$(ls -d "$OUT"/seed* | head -n 1)
"$PY" -m mpisolve plot "$first/allreduce.jsonl" "$first/kfac.jsonl" --out "$OUT"
