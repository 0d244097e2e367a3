"""``bench step`` of several revisions of mpisolve, alternating, on one machine in one run.

Each revision (a git revision, or ``worktree`` for the working tree) is exported with
``git archive`` into a temporary directory and put first on ``PYTHONPATH``; the runs go
A, B, ..., A, B, ... for ``--rounds`` rounds, so that outside load falls on all alike.
Each line of the output is one run's JSON (``bench step``'s, plus ``revision`` and
``round``); compare ``solver_over_plain`` (the step against plain PyTorch, measured in the
same process), not seconds taken at other times. With ``PERF_LOCK`` set, every run holds
that lock (flock) while it measures.

    python perf/step_ab.py --revisions 5c01ce4 worktree --ranks 2 -- --model mlp --batch 32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def export(revision: str, into: Path) -> Path:
    """The tree of ``revision`` under ``into`` (the working tree itself for ``worktree``), importable."""
    if revision == "worktree":
        return ROOT
    tree = into / revision
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    (tree / "mpisolve" / "kernels").symlink_to("../kernels")  # installed as mpisolve.kernels
    return tree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--revisions", nargs="+", required=True, help="git revisions, or worktree")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- then bench step's own arguments")
    args = parser.parse_args()
    bench = [a for a in args.bench if a != "--"]
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    lock = os.environ.get("PERF_LOCK")
    with tempfile.TemporaryDirectory() as tmp:
        trees = {revision: export(revision, Path(tmp)) for revision in args.revisions}
        for round_ in range(1, args.rounds + 1):
            for revision, tree in trees.items():
                command = [mpiexec, "-n", str(args.ranks), sys.executable, "-m", "mpi4py", "-m", "mpisolve"]
                command += ["bench", "step", *bench]
                if lock:
                    command = ["flock", lock, *command]
                env = {**os.environ, "PYTHONPATH": str(tree)}
                done = subprocess.run(command, env=env, cwd=tmp, check=True, capture_output=True, text=True)
                result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
                print(json.dumps({"revision": revision, "round": round_, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
