"""A real one-node Slurm cluster on loopback, for the job template tests.

:func:`ensure_slurm` installs Debian's slurmctld, slurmd, slurm-client and munge when
they are missing (apt-get, --no-install-recommends). :class:`SlurmCluster` starts
munged, slurmctld and slurmd in the foreground as children of this process, without
systemd, with every file (config, key, socket, state, spool, logs, the stand-in GPU
devices) under one directory
and on free TCP ports, so that it touches nothing of the machine's own Slurm or munge.
``stop`` cancels the jobs and stops everything by PID; should this process die first,
the kernel sends the daemons SIGTERM.
"""

from __future__ import annotations

import contextlib
import ctypes
import grp
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
PROGRAMS = ("slurmctld", "slurmd", "sbatch", "squeue", "scancel", "munged")
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
REPO = Path(__file__).resolve().parents[2]
#: Environment of the test process that must not reach the jobs (a Slurm or MPI job around pytest).
FOREIGN_ENV = ("SLURM_", "PMI_", "PMIX_", "HYDRA_", "MPI_", "OMPI_", "VIRTUAL_ENV")

SLURM_CONF = """\
ClusterName=mpisolve-test
# MPICH names its shared-memory segments after the PMI job id; segments left in /dev/shm
# by a killed job would hang the next cluster's job 1.0 in MPI_Init. Start elsewhere.
FirstJobId={first_job_id}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
# cgroups do not work in these VMs.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Without a PMI plugin, srun -n 4 starts four 1-rank programs.
MpiDefault=pmi2
ReturnToService=2
# 4-rank jobs on a 2-core machine, four at once: trust CPUs=16 below, and refuse
# impossible jobs at once.
SlurmdParameters=config_overrides
EnforcePartLimits=ALL
# Four GPUs for the GPU template, which are plain files (gres.conf): Slurm schedules
# --gpus-per-node against them; torch finds no GPU, so those ranks train on the CPU.
GresTypes=gpu
NodeName={host} NodeAddr=127.0.0.1 CPUs=16 Gres=gpu:4 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=5 State=UP
"""


def _run(cmd: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


def ensure_slurm() -> None:
    """Install Slurm and munge with apt-get if they are missing; skip where that cannot work."""
    if os.geteuid() != 0:
        pytest.skip("the Slurm test needs root (to install Slurm and run slurmd)")
    if all(shutil.which(p, path=SEARCH_PATH) for p in PROGRAMS):
        return
    if shutil.which("apt-get") is None:
        pytest.skip("the Slurm test installs Slurm with apt-get, which this machine lacks")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = ["-o", "DPkg::Lock::Timeout=120"]
    for cmd, timeout_s in (
        (["apt-get", "update", "-qq"], 120),
        (["apt-get", "install", "-y", "-qq", "--no-install-recommends", *lock, *PACKAGES], 240),
    ):
        done = _run(cmd, timeout=timeout_s, env=env)
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it ends."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


@dataclass
class JobResult:
    returncode: int  # the job's exit status, -1 if it did not end in time
    output: str  # what sbatch printed, then the job's stdout and stderr


class BatchJob:
    """A job submitted with ``sbatch --wait``, which runs in the background until the job ends."""

    def __init__(self, cmd: list[str], output: Path, env: dict[str, str], timeout_s: float) -> None:
        self.output = output
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO
        )

    def result(self) -> JobResult:
        """Wait for the job (until ``timeout_s`` after submission); its exit status and everything printed."""
        try:
            printed, _ = self.proc.communicate(timeout=max(0.1, self.deadline - time.monotonic()))
            status = self.proc.returncode
        except subprocess.TimeoutExpired:
            self.proc.kill()
            printed, status = self.proc.communicate()[0] + f"sbatch --wait: no end within {self.timeout_s:g} s\n", -1
        return JobResult(status, printed + (self.output.read_text() if self.output.exists() else ""))


class SlurmCluster:
    """munged + slurmctld + slurmd for one node named after this host, all under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.daemons: dict[str, subprocess.Popen] = {}
        self._submitted = 0

    # ---------------------------------------------------------------- start
    def start(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True)
        self._start_munge()
        for i in range(4):
            (self.root / f"gpu{i}").touch()
        (self.root / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName={self.host} Name=gpu File={self.root}/gpu[0-3]\n"
        )
        self.conf.write_text(
            SLURM_CONF.format(
                host=self.host,
                root=self.root,
                ctld_port=_free_port(),
                slurmd_port=_free_port(),
                first_job_id=random.randrange(10**5, 6 * 10**7),
            )
        )
        self._spawn([self._sbin("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._spawn([self._sbin("slurmd"), "-D", "-f", str(self.conf)])
        self._wait_for(lambda: self.query(["sinfo", "-h", "-o", "%T"]) == "idle", 30, "the node to become idle")

    def _start_munge(self) -> None:
        # munged wants its socket directory traversable by all and its key owned and
        # readable by the munge user alone.
        munge = self.root / "munge"
        munge.mkdir(mode=0o755)
        self.root.chmod(0o755)
        uid, gid = pwd.getpwnam("munge").pw_uid, grp.getgrnam("munge").gr_gid
        key = munge / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        for path in (munge, key):
            os.chown(path, uid, gid)
        self._spawn(
            [
                self._sbin("munged"),
                "--foreground",
                f"--socket={munge}/munge.socket",
                f"--key-file={key}",
                f"--pid-file={munge}/munged.pid",
                f"--log-file={munge}/munged.log",
                f"--seed-file={munge}/munged.seed",
            ],
            user="munge",
            group="munge",
        )
        self._wait_for(lambda: (munge / "munge.socket").exists(), 15, "munged's socket")

    @staticmethod
    def _sbin(program: str) -> str:
        return shutil.which(program, path=SEARCH_PATH) or program

    def _spawn(self, cmd: list[str], **kwargs: Any) -> None:
        log = open(self.root / "log" / f"{Path(cmd[0]).name}.console", "w")  # the daemon keeps it
        # SLURM_CONF in the daemons' environment marks them and their job steps as this cluster's.
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env(),
            preexec_fn=_die_with_parent,
            **kwargs,
        )
        log.close()
        self.daemons[Path(cmd[0]).name] = proc
        time.sleep(0.2)
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited with status {proc.returncode} at start:\n{self.logs()}")

    def _wait_for(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [name for name, p in self.daemons.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"gave up waiting for {what} ({'exited: ' + ', '.join(dead) if dead else 'timeout'}):\n"
                    f"{self.logs()}"
                )
            time.sleep(0.2)

    # ------------------------------------------------------------------ use
    def env(self, **extra: str) -> dict[str, str]:
        """The environment for Slurm commands and jobs: this cluster, this Python first on PATH."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(FOREIGN_ENV)}
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), SEARCH_PATH])
        env.update(extra)
        return env

    def query(self, cmd: list[str]) -> str:
        done = _run(cmd, timeout=20, env=self.env())
        return done.stdout.strip() if done.returncode == 0 else ""

    def submit(
        self, script: Path, *args: str, env: dict[str, str], sbatch: tuple[str, ...] = (), timeout_s: float = 150
    ) -> BatchJob:
        """``sbatch --wait [sbatch options] script args`` from the repository root, in the background."""
        self._submitted += 1
        output = self.root / f"job-{self._submitted}.out"
        cmd = ["sbatch", "--wait", "--time=4", f"--output={output}", *sbatch, str(script), *args]
        return BatchJob(cmd, output, self.env(**env), timeout_s)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted((self.root / "log").glob("*"))
        )

    # ----------------------------------------------------------------- stop
    def stop(self) -> None:
        """Cancel the jobs, stop the daemons by PID, then kill by PID whatever of the jobs is left."""
        try:
            self._cancel_jobs()
        finally:
            for proc in self.daemons.values():
                proc.terminate()
            deadline = time.monotonic() + 5
            for proc in self.daemons.values():
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
            self.daemons.clear()
            for pid in self._leftover_pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def _cancel_jobs(self) -> None:
        ctld = self.daemons.get("slurmctld")
        if ctld is None or ctld.poll() is not None:
            return
        try:
            _run(["scancel", "--user=root"], timeout=20, env=self.env())
            self._wait_for(lambda: self.query(["squeue", "-h", "-o", "%i"]) == "", 20, "the queue to drain")
        except (RuntimeError, subprocess.TimeoutExpired):
            pass  # stop() kills what scancel did not end

    def _leftover_pids(self) -> list[int]:
        """Processes of this cluster (their environment names its slurm.conf): job steps, ranks."""
        marker = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if marker in (entry / "environ").read_bytes().split(b"\0"):
                        pids.append(int(entry.name))
                except OSError:
                    pass  # gone, or not ours to read
        return pids
