"""The summary of perf/horovod_suite.sh: Horovod's tests against mpisolve.horovod, per size.

``report OUT``: reads OUT/n<N>/{alone.<test>,whole,no-muon}-<rank>.xml (JUnit, one per
rank and run) and prints Markdown: per size and file, how many tests passed, failed and
were skipped (by reason) when each ran alone; every test that did not pass everywhere,
with its first message; the same counts for the run of both files together, and the
optimizer-loop tests without torch.optim.Muon.
"""

from __future__ import annotations

import argparse
import re
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

Outcome = tuple[str, str]  # (passed | failed | skipped | no result, first line of its message)


def outcomes(files: list[Path]) -> dict[str, list[Outcome]]:
    """test id (file::name) -> one outcome per rank's file (a rank with no file gave no result)."""
    per_test: dict[str, list[Outcome]] = {}
    for path in files:
        for case in ET.parse(path).getroot().iter("testcase"):
            module = case.get("classname", "").split(".")[0]
            key = f"{module}.py::{case.get('name')}"
            per_test.setdefault(key, []).append(_outcome(case))
    return per_test


def _outcome(case: ET.Element) -> Outcome:
    for tag in ("failure", "error"):
        found = case.find(tag)
        if found is not None:
            return "failed", (found.get("message") or "").splitlines()[0][:160] if found.get("message") else tag
    skipped = case.find("skipped")
    if skipped is not None:
        return "skipped", (skipped.get("message") or "").splitlines()[0][:160]
    return "passed", ""


def combined(results: list[Outcome], ranks: int) -> Outcome:
    """One outcome over the ranks: failed if any rank failed, no result if a rank wrote none."""
    if len(results) < ranks:
        return "no result", "a rank wrote no result (killed at its time limit, or crashed)"
    for outcome in ("failed", "skipped"):
        hits = [r for r in results if r[0] == outcome]
        if hits:
            return hits[0]
    return "passed", ""


def skip_reason(message: str) -> str:
    if re.search(r"GPU", message):
        return "needs a GPU"
    if "Gloo" in message:
        return "needs Gloo"
    return "skipped by Horovod"


def report(out: Path) -> str:
    lines = ["# Horovod's tests against mpisolve.horovod", ""]
    for size_dir in sorted(out.glob("n*")):
        ranks = int(size_dir.name[1:])
        run = (size_dir / "run.txt").read_text().split("\n") if (size_dir / "run.txt").exists() else ["?", "?"]
        lines += [f"## {ranks} ranks (run {run[0]}, commit {run[1]})", ""]
        alone: dict[str, Outcome] = {}
        for test, results in outcomes(sorted(size_dir.glob("alone.*.xml"))).items():
            alone[test] = combined(results, ranks)
        expected = {p.stem.removeprefix("alone.") for p in size_dir.glob("alone.*.log")}
        for name in expected:
            if not any(t.endswith("::" + name) for t in alone):
                alone[f"?::{name}"] = ("no result", "no rank wrote a result")
        lines.append("Each test in its own run:")
        lines.append("")
        lines.append("| file | tests | passed | failed or no result | skipped (reason: count) |")
        lines.append("| --- | --- | --- | --- | --- |")
        for module in sorted({t.split("::")[0] for t in alone}):
            mine = {t: o for t, o in alone.items() if t.split("::")[0] == module}
            counts = Counter(o[0] for o in mine.values())
            reasons = Counter(skip_reason(o[1]) for o in mine.values() if o[0] == "skipped")
            skipped = ", ".join(f"{r}: {c}" for r, c in sorted(reasons.items())) or "0"
            bad = counts["failed"] + counts["no result"]
            lines.append(f"| {module} | {len(mine)} | {counts['passed']} | {bad} | {skipped} |")
        lines.append("")
        bad_tests = sorted((t, o) for t, o in alone.items() if o[0] in ("failed", "no result"))
        if bad_tests:
            lines += ["| test | outcome | first message |", "| --- | --- | --- |"]
            lines += [f"| {t} | {o[0]} | {o[1].replace('|', '/')} |" for t, o in bad_tests]
            lines.append("")
        for label, prefix in (("Both files in one run", "whole"), ("Without torch.optim.Muon", "no-muon")):
            results = outcomes(sorted(size_dir.glob(f"{prefix}-*.xml")))
            merged = {t: combined(r, ranks) for t, r in results.items()}
            counts = Counter(o[0] for o in merged.values())
            summary = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "no result"
            lines.append(f"{label}: {summary}.")
            failed = sorted(t for t, o in merged.items() if o[0] in ("failed", "no result"))
            if failed:
                lines.append(f"Not passed: {', '.join(failed)}.")
            lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("command", choices=["report"])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    print(report(args.out))


if __name__ == "__main__":
    main()
