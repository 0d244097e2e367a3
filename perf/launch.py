"""What the perf/ scripts share: the mpiexec to use and one MPI run of mpisolve."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def mpiexec() -> str:
    """$MPIEXEC, else the mpiexec beside this Python (the venv's), else the one on PATH."""
    beside = Path(sys.executable).with_name("mpiexec")
    return os.environ.get("MPIEXEC") or (str(beside) if beside.exists() else shutil.which("mpiexec") or "mpiexec")


def run_mpisolve(ranks: int, args: Sequence[str], *, timeout_s: float, env: Mapping[str, str] | None = None) -> str:
    """``mpiexec -n ranks python -m mpi4py -m mpisolve args``; its stdout (fails loudly).

    With ``PERF_LOCK`` set (a file), the run holds ``flock PERF_LOCK`` while it runs, so
    that a shared machine runs one measurement at a time.
    """
    lock = os.environ.get("PERF_LOCK")
    command = (["flock", lock] if lock else []) + [
        mpiexec(),
        "-n",
        str(ranks),
        sys.executable,
        "-m",
        "mpi4py",
        "-m",
        "mpisolve",
        *args,
    ]
    print("+", " ".join(command), flush=True)
    full_env = {**os.environ, "MPIEXEC_TIMEOUT": str(int(timeout_s)), **(env or {})}
    done = subprocess.run(command, check=True, timeout=timeout_s + 30, env=full_env, stdout=subprocess.PIPE, text=True)
    return done.stdout
