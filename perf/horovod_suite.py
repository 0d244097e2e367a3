"""Horovod's tests against mpisolve.horovod: the runs of perf/horovod_suite.sh and their summary.

``run``: at one size, every test of the files, each to a result on every rank: pytest runs
the files under ``mpiexec`` with ``-x``; after the first failure (a test that fails on some
ranks only leaves the others inside a collective that no later test would match, until
the job ends), the next run starts after it, leaving out the tests that already have
results on every rank. Each run holds the CPU lock and is bounded (pytest-timeout per
test, ``timeout`` per run). Writes ``outcomes.json`` (test -> [outcome, message]) and
each run's per-rank outcome lines (``run<K>-<rank>.jsonl``) and log. Then both files in one run (``whole``: what
leaks between tests), and the tests that loop over every ``torch.optim`` class once more
without ``torch.optim.Muon`` (``no-muon``; see perf/horovod_standin/no_muon.py).

``report OUT``: Markdown per size: counts per file (skips by reason), every test that did
not pass with its first message, and the two extra runs' counts.

``examples TREE``: what Horovod's examples/pytorch scripts use of ``hvd`` (every
``hvd.<name>`` and the keywords of every call), looked up in ``mpisolve.horovod``: the
names it lacks and the keywords its functions do not take (perf/horovod_examples.sh runs
the scripts themselves).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import re
import subprocess
from collections import Counter
from pathlib import Path

FILES = ["test_torch.py", "test_adasum_pytorch.py"]
#: One rank's pytest under mpiexec: each test's outcome written as it ends (perf/horovod_standin/suite_log.py).
RANK = 'HOROVOD_SUITE_LOG="$1" exec "$0" -m mpi4py -m pytest -p no:cacheprovider -p suite_log -q --rootdir=. \
--timeout=300 --timeout-method=thread "${@:2}"'

Outcome = tuple[str, str]  # (passed | failed | skipped | no result, first line of its message)


def outcomes(files: list[Path]) -> dict[str, list[Outcome]]:
    """pytest node id -> one outcome per rank (a rank's file per run; its worst report of the test)."""
    rank_of: dict[str, dict[Path, Outcome]] = {}
    order = {"passed": 0, "skipped": 1, "failed": 2}
    for path in files:
        for line in path.read_text().splitlines():
            report = json.loads(line)
            mine = rank_of.setdefault(report["id"], {})
            seen = mine.get(path)
            if seen is None or order[report["outcome"]] > order[seen[0]]:
                mine[path] = (report["outcome"], report["message"])
    return {test: list(by_rank.values()) for test, by_rank in rank_of.items()}


def combined(results: list[Outcome], ranks: int) -> Outcome:
    """One outcome over the ranks: failed if any rank failed (a rank whose part passed may be
    left waiting for the others, who stopped: it gives none), else no result if a rank gave
    none, else skipped or passed."""
    failed = [r for r in results if r[0] == "failed"]
    if failed:
        return failed[0]
    if len(results) < ranks:
        return "no result", "a rank gave no result (killed at its time limit, or crashed)"
    skipped = [r for r in results if r[0] == "skipped"]
    return skipped[0] if skipped else ("passed", "")


def pytest_run(args: argparse.Namespace, prefix: Path, pytest_args: list[str]) -> dict[str, list[Outcome]]:
    """One bounded mpiexec of pytest under the lock; the ranks' outcomes."""
    for old in prefix.parent.glob(prefix.name + "-*.jsonl"):
        old.unlink()
    command = ["flock", args.lock, "timeout", "900", args.mpiexec, "-n", str(args.ranks), "bash", "-c", RANK]
    with open(prefix.with_suffix(".log"), "w") as log:
        subprocess.run([*command, args.python, str(prefix), *pytest_args], cwd=args.tests, stdout=log, stderr=log)
    return outcomes(sorted(prefix.parent.glob(prefix.name + "-*.jsonl")))


def run(args: argparse.Namespace) -> None:
    out = args.out / f"n{args.ranks}"
    out.mkdir(parents=True, exist_ok=True)
    listed = subprocess.run(
        [args.python, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir=.", "--collect-only", "-q", *FILES],
        cwd=args.tests,
        capture_output=True,
        text=True,
    ).stdout
    ids = [line for line in listed.splitlines() if "::" in line and re.search(args.only, line)]
    done: dict[str, Outcome] = {}
    runs = 0
    while len(done) < len(ids):
        runs += 1
        left = [i for i in ids if i not in done]
        results = pytest_run(args, out / f"run{runs}", ["-x", *left])
        if not results:  # no test started on any rank: pytest itself failed (see the log)
            raise SystemExit(f"no test ran: {out / f'run{runs}.log'}")
        progressed = False
        for test in left:
            outcome = combined(results.get(test, []), args.ranks)
            if outcome[0] == "no result":
                break  # not run to the end on every rank: again next run
            done[test] = outcome
            progressed = True
            if done[test][0] == "failed":
                break
        if not progressed:  # it ended the run on some rank without a result: it gets none
            done[left[0]] = combined(results.get(left[0], []), args.ranks)
    (out / "outcomes.json").write_text(json.dumps(done, indent=1))
    whole = pytest_run(args, out / "whole", FILES)
    (out / "whole.json").write_text(json.dumps({t: combined(r, args.ranks) for t, r in whole.items()}, indent=1))
    loops = pytest_run(args, out / "no-muon", ["-p", "no_muon", "-k", "broadcast_state or force_allreduce", FILES[0]])
    (out / "no-muon.json").write_text(json.dumps({t: combined(r, args.ranks) for t, r in loops.items()}, indent=1))


def skip_reason(message: str) -> str:
    if "GPU" in message:
        return "needs a GPU"
    if "Gloo" in message:
        return "needs Gloo"
    return "skipped by Horovod itself"


def report(out: Path) -> str:
    lines = ["# Horovod's tests against mpisolve.horovod", ""]
    for size_dir in sorted(out.glob("n*")):
        ranks = size_dir.name[1:]
        run_txt = (size_dir / "run.txt").read_text().splitlines() if (size_dir / "run.txt").exists() else ["?"] * 2
        lines += [f"## {ranks} ranks (run {run_txt[0]}, commit {run_txt[1]})", ""]
        alone: dict[str, list[str]] = json.loads((size_dir / "outcomes.json").read_text())
        lines += ["| file | tests | passed | not passed | skipped (reason: count) |", "| --- | --- | --- | --- | --- |"]
        for module in FILES:
            mine = {t: o for t, o in alone.items() if t.startswith(module)}
            counts = Counter(o[0] for o in mine.values())
            reasons = Counter(skip_reason(o[1]) for o in mine.values() if o[0] == "skipped")
            skipped = ", ".join(f"{r}: {c}" for r, c in sorted(reasons.items())) or "0"
            not_passed = len(mine) - counts["passed"] - counts["skipped"]
            lines.append(f"| {module} | {len(mine)} | {counts['passed']} | {not_passed} | {skipped} |")
        lines.append("")
        bad = sorted((t, o) for t, o in alone.items() if o[0] not in ("passed", "skipped"))
        if bad:
            lines += ["| test | outcome | first message |", "| --- | --- | --- |"]
            lines += [f"| {t.split('::')[-1]} | {o[0]} | {o[1].replace('|', '/')} |" for t, o in bad]
            lines.append("")
        for label, name in (
            ("Both files in one run", "whole"),
            ("The optimizer loops without torch.optim.Muon", "no-muon"),
        ):
            path = size_dir / f"{name}.json"
            merged: dict[str, list[str]] = json.loads(path.read_text()) if path.exists() else {}
            counts = Counter(o[0] for o in merged.values())
            lines.append(f"{label}: " + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "no result") + ".")
            failed = sorted(t.split("::")[-1] for t, o in merged.items() if o[0] not in ("passed", "skipped"))
            if failed:
                lines.append(f"Not passed: {', '.join(failed)}.")
            lines.append("")
    return "\n".join(lines)


def examples(tree: Path) -> str:
    """Each example's uses of ``hvd`` that mpisolve.horovod lacks (an empty list: none)."""
    import mpisolve.horovod as hvd

    lines = ["# Horovod's examples/pytorch against mpisolve.horovod", ""]
    for script in sorted((tree / "examples" / "pytorch").glob("*.py")):
        used: set[str] = set()
        missing: list[str] = []
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "hvd":
                used.add(node.attr)
                if not hasattr(hvd, node.attr):
                    missing.append(f"hvd.{node.attr}")
            func = node.func if isinstance(node, ast.Call) else None
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "hvd":
                target = getattr(hvd, func.attr, None)
                taken = set(inspect.signature(target).parameters) if callable(target) else set()
                assert isinstance(node, ast.Call)
                missing += [f"hvd.{func.attr}({k.arg}=)" for k in node.keywords if k.arg and k.arg not in taken]
        names = ", ".join(sorted(used))
        lines.append(f"- {script.name}: uses {len(used)} names ({names}); missing: {missing or 'none'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    runner = sub.add_parser("run")
    runner.add_argument("--tests", type=Path, required=True, help="the tree's test/parallel")
    runner.add_argument("--ranks", type=int, required=True)
    runner.add_argument("--out", type=Path, required=True)
    runner.add_argument("--python", required=True)
    runner.add_argument("--mpiexec", required=True)
    runner.add_argument("--lock", required=True)
    runner.add_argument("--only", default=".", help="regex: the tests to run (default all)")
    reporter = sub.add_parser("report")
    reporter.add_argument("out", type=Path)
    scanner = sub.add_parser("examples")
    scanner.add_argument("tree", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        run(args)
    elif args.command == "report":
        print(report(args.out))
    else:
        print(examples(args.tree))


if __name__ == "__main__":
    main()
