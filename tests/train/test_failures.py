"""A failing rank ends the job: real ``mpiexec`` runs of ``mpisolve train`` where one rank fails.

Each test launches its own job (2 ranks: the failing one must bring the other down) with
``MPISOLVE_FAULT`` making rank 1 fail in training step 5, and checks that the job ends,
non-zero, within 30 s of the failure, with no rank left running. Every registered solver
is run once; which failure it gets alternates along the registry (an exception or a
SIGKILL), so each kind meets
synchronous, locked-window and wild-window solvers. A stalled rank is caught by the
others' watchdog (``--comm-timeout``). A run killed and resumed ends as an uninterrupted one.

The jobs mostly wait (for their ranks to start, for a failure to end them), so the
module starts every selected test's job up front, ``PARALLEL_JOBS`` at a time, and each
test checks its own job's outcome.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import mpisolve
from mpisolve.train.checkpoint import CheckpointDir

BIN = Path(sys.executable).parent
#: ``MPISOLVE_TEST_HOSTS=nodeA:2,nodeB:2``: the jobs run on the emulated cluster (tests/cluster/fake-ssh).
HOSTS = os.environ.get("MPISOLVE_TEST_HOSTS")
RANKS = sum(int(h.split(":")[1]) for h in HOSTS.split(",")) if HOSTS else 2
LAUNCH = (
    ["-launcher", "ssh", "-launcher-exec", str(Path(__file__).parents[1] / "cluster" / "fake-ssh"), "-hosts", HOSTS]
    if HOSTS
    else []
)
FAILING_RANK = 1
#: The job must end within this many seconds of the failure (the issue's bound).
END_WITHIN_S = 30
#: Starting the ranks (torch, MPI, data) before the failure: generous on a loaded machine.
START_WITHIN_S = 120
KINDS = ("raise", "kill")
#: Jobs running at once (on a 2-core machine they still end well within the bound).
PARALLEL_JOBS = 4


def solver_faults() -> list[tuple[str, str]]:
    """Every registered solver with the failure it is tested with (alternating along the registry)."""
    return [(name, KINDS[i % len(KINDS)]) for i, name in enumerate(mpisolve.solver_names())]


def survivors(marker: str) -> list[int]:
    """Pids of processes still running with ``marker`` in their environment."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if marker.encode() in environ:
            found.append(int(proc.name))
    return found


def describe(pid: int) -> str:
    """State and command line of a process, for the failure message."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        return state + " " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "gone"


def train_command(*args: str) -> list[str]:
    return [
        str(BIN / "mpiexec"),
        *LAUNCH,
        "-n",
        str(RANKS),
        sys.executable,
        "-m",
        "mpi4py",
        "-m",
        "mpisolve",
        "train",
        *args,
    ]


def run_failing_job(fault: str, *args: str) -> tuple[int, str, float]:
    """Launch ``train *args`` with ``fault``; (exit status, stderr, seconds from the failure to the end)."""
    marker = f"MPISOLVE_TEST_RUN={uuid.uuid4().hex}"
    env = dict(os.environ, MPISOLVE_FAULT=fault, MPIEXEC_TIMEOUT=str(START_WITHIN_S + END_WITHIN_S))
    env.update([marker.split("=")])
    cmd = train_command(*args)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    failed = threading.Event()
    failed_at = 0.0

    def drain() -> None:  # read stderr as it comes, so no rank ever blocks writing to it
        nonlocal failed_at
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("MPISOLVE_FAULT:") and not failed.is_set():
                failed_at = time.monotonic()
                failed.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + START_WITHIN_S
        while not failed.wait(0.2) and proc.poll() is None and time.monotonic() < deadline:
            pass
        assert failed.is_set(), "the fault never fired:\n" + "".join(lines)
        status = proc.wait(timeout=END_WITHIN_S)
        # mpiexec has returned; its ranks may take a moment more to be torn down.
        while survivors(marker) and time.monotonic() - failed_at < END_WITHIN_S:
            time.sleep(0.1)
        ended = time.monotonic() - failed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
    left = {pid: describe(pid) for pid in survivors(marker)}
    assert not left, f"processes of the job still running {END_WITHIN_S} s after the failure: {left}"
    print(f"MPISOLVE_FAULT={fault} {' '.join(args[:2])}: exit {status}, ended {ended:.1f} s after the failure")
    return status, "".join(lines), ended


def long_run(solver: str) -> list[str]:
    """A run that would last far longer than the tests: it ends only by the failure."""
    return [
        "--solver",
        solver,
        "--model",
        "mlp",
        "--batch-size",
        "16",
        "--momentum",
        "0",
        "--steps",
        "100000",
        "--log-every",
        "5",
    ]


RESUMED_RUN = ["--solver", "allreduce", "--model", "mlp", "--batch-size", "16", "--momentum", "0.9", "--steps", "12"]


def resume_jobs(tmp_path: Path) -> dict[str, object]:
    """In ``tmp_path``: a run, the same run SIGKILLed after its step-8 checkpoint, and its resumption."""
    env = dict(os.environ, MPIEXEC_TIMEOUT="120")
    outcome: dict[str, object] = {"dir": tmp_path}
    outcome["whole"] = subprocess.run(
        train_command(*RESUMED_RUN, "--checkpoint-dir", str(tmp_path / "whole")),
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    parts = ["--checkpoint-dir", str(tmp_path / "parts"), "--checkpoint-every", "4"]
    outcome["killed"] = run_failing_job(f"{FAILING_RANK}:10:kill", *RESUMED_RUN, *parts)
    outcome["checkpoint_step"] = CheckpointDir(tmp_path / "parts", rank=0, size=RANKS).read_rank({})[0]
    outcome["resumed"] = subprocess.run(
        train_command(*RESUMED_RUN, *parts, "--resume"),
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    return outcome


#: Each test's job, given a fresh directory and the test's parameters; the longest first (it starts first).
JOBS: dict[str, Callable[..., object]] = {
    "test_killed_run_resumed_from_its_checkpoint_ends_as_the_uninterrupted_run": resume_jobs,
    "test_stalled_rank_is_caught_by_the_watchdog": lambda tmp_path, solver: run_failing_job(
        f"{FAILING_RANK}:5:stall", *long_run(solver), "--comm-timeout", "3"
    ),
    "test_failing_rank_ends_the_job": lambda tmp_path, solver, kind: run_failing_job(
        f"{FAILING_RANK}:5:{kind}", *long_run(solver)
    ),
}


@pytest.fixture(scope="module")
def jobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The jobs of this module's selected tests, all started now, ``PARALLEL_JOBS`` at a time: node id -> future."""
    items = [item for item in request.session.items if item.module is request.module and item.originalname in JOBS]
    items.sort(key=lambda item: list(JOBS).index(item.originalname))
    with ThreadPoolExecutor(PARALLEL_JOBS) as pool:
        futures: dict[str, Future] = {}
        for item in items:
            params = item.callspec.params if hasattr(item, "callspec") else {}
            futures[item.nodeid] = pool.submit(JOBS[item.originalname], tmp_path_factory.mktemp("job"), **params)
        yield futures


@pytest.mark.slow
@pytest.mark.parametrize("solver, kind", solver_faults())
def test_failing_rank_ends_the_job(solver, kind, jobs, request):
    status, stderr, ended = jobs[request.node.nodeid].result()
    assert status != 0, stderr
    assert ended <= END_WITHIN_S
    # The traceback itself may be cut short when mpiexec tears the job down; the line before it is not.
    assert f"MPISOLVE_FAULT: rank 1 fails ({kind}) at training step 5" in stderr


@pytest.mark.slow
@pytest.mark.parametrize("solver", ["async-easgd"])  # blocking collectives: tests/comm/test_communicator.py
def test_stalled_rank_is_caught_by_the_watchdog(solver, jobs, request):
    status, stderr, ended = jobs[request.node.nodeid].result()
    assert status != 0, stderr
    assert "CommTimeout: mpisolve:" in stderr and "did not complete within 3 s" in stderr
    assert ended <= END_WITHIN_S


@pytest.mark.slow
def test_killed_run_resumed_from_its_checkpoint_ends_as_the_uninterrupted_run(jobs, request):
    outcome = jobs[request.node.nodeid].result()
    assert outcome["whole"].returncode == 0, outcome["whole"].stderr
    status, stderr, _ = outcome["killed"]
    assert status != 0, stderr
    assert outcome["checkpoint_step"] == 8  # killed at step 10, after step 8's checkpoint
    assert outcome["resumed"].returncode == 0, outcome["resumed"].stderr
    for rank in range(RANKS):
        states = [CheckpointDir(outcome["dir"] / d, rank=rank, size=RANKS).read_rank({}) for d in ("whole", "parts")]
        assert states[0][0] == states[1][0] == 12
        for name, value in states[0][1]["model"].items():
            assert torch.equal(value, states[1][1]["model"][name]), name  # bit for bit
