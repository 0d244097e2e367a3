"""What the perf/ scripts share: the mpiexec to use, one MPI run of mpisolve, the machine
lock, and how much of the machine other processes used meanwhile."""

from __future__ import annotations

import fcntl
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def mpiexec() -> str:
    """$MPIEXEC, else the mpiexec beside this Python (the venv's), else the one on PATH."""
    beside = Path(sys.executable).with_name("mpiexec")
    return os.environ.get("MPIEXEC") or (str(beside) if beside.exists() else shutil.which("mpiexec") or "mpiexec")


@contextmanager
def machine_lock() -> Iterator[None]:
    """Hold ``flock $PERF_LOCK`` (if set), so that a shared machine runs one measurement at a time."""
    path = os.environ.get("PERF_LOCK")
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (/proc/stat: all but idle and iowait;
    steal, the hypervisor's other guests, counts as busy)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and of the children it has waited for (their children too)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


@contextmanager
def outside_load() -> Iterator[dict[str, float]]:
    """While the block runs, how many cores' worth other processes kept busy: the
    machine's busy time less this process's and its finished children's, over the wall
    time; ``usage["outside_cores"]`` and ``usage["wall_s"]`` are set when the block ends."""
    usage: dict[str, float] = {}
    busy, own, start = _machine_busy_s(), _own_cpu_s(), time.perf_counter()
    yield usage
    wall = time.perf_counter() - start
    outside = (_machine_busy_s() - busy) - (_own_cpu_s() - own)
    usage.update(wall_s=wall, outside_cores=max(0.0, outside) / wall)


def run_mpisolve(
    ranks: int,
    args: Sequence[str],
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    usage: dict[str, float] | None = None,
) -> str:
    """``mpiexec -n ranks python -m mpi4py -m mpisolve args``; its stdout (fails loudly).

    The run holds the machine lock (:func:`machine_lock`); ``usage``, if given, gets the
    outside load while it ran (:func:`outside_load`).
    """
    command = [
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
    with machine_lock(), outside_load() as measured:
        done = subprocess.run(
            command, check=True, timeout=timeout_s + 30, env=full_env, stdout=subprocess.PIPE, text=True
        )
    if usage is not None:
        usage.update(measured)
    return done.stdout
