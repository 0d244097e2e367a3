"""What the perf/ scripts share: the mpiexec to use, one MPI run of mpisolve, the machine
lock, and how much of the machine other processes used meanwhile."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np

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


def _tree_cpu_s() -> float:
    """CPU seconds of this process and its descendants: the live ones' own and their
    finished children's (/proc/PID/stat: utime, stime, cutime, cstime)."""
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        cpu[int(entry)] = sum(int(v) for v in fields[11:15]) / tick
    total, stack = 0.0, [os.getpid()]
    while stack:
        pid = stack.pop()
        total += cpu.get(pid, 0.0)
        stack.extend(children.get(pid, ()))
    return total


class OutsideLoad:
    """How many cores' worth other processes kept busy while a run measured: every
    ``interval`` seconds (from a thread) the machine's busy time (/proc/stat) less this
    process tree's CPU time; :meth:`cores` over the whole run or a part of it."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.samples: list[tuple[float, float]] = []  # (wall-clock time, outside CPU seconds since the start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)
        self._base = (0.0, 0.0)

    def _sample(self) -> None:
        machine, own = _machine_busy_s(), _tree_cpu_s()
        self.samples.append((time.time(), (machine - self._base[0]) - (own - self._base[1])))

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> OutsideLoad:
        self._base = (_machine_busy_s(), _tree_cpu_s())
        self.samples = [(time.time(), 0.0)]
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def cores(self, start: float | None = None, end: float | None = None) -> float:
        """Other processes' cores between two wall-clock times (default: the whole run)."""
        times = [t for t, _ in self.samples]
        used = [u for _, u in self.samples]
        start = times[0] if start is None else max(start, times[0])
        end = times[-1] if end is None else min(end, times[-1])
        if end <= start:
            return 0.0
        return max(0.0, float(np.interp(end, times, used) - np.interp(start, times, used))) / (end - start)


def run_mpisolve(
    ranks: int,
    args: Sequence[str],
    *,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    load: OutsideLoad | None = None,
) -> str:
    """``mpiexec -n ranks python -m mpi4py -m mpisolve args``; its stdout (fails loudly).

    The run holds the machine lock (:func:`machine_lock`); ``load``, if given, measures
    the other processes' load while it runs.
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
    with machine_lock(), load if load is not None else nullcontext():
        done = subprocess.run(
            command, check=True, timeout=timeout_s + 30, env=full_env, stdout=subprocess.PIPE, text=True
        )
    return done.stdout
