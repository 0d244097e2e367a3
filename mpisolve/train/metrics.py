"""What a run reports: JSON Lines records while it trains, and a summary when it ends.

Rank 0 writes both. A record (one JSON object per line)::

    {"step": 40, "epoch": 1.02, "wall_s": 3.1, "loss": 0.41, "train_accuracy": 0.88,
     "test_accuracy": 0.91 or null, "test_loss": 0.30 or null, "global_samples": 128,
     "samples_per_s": 1650.0, "busy": [per rank], "comm": [per rank], "idle": [per rank]}

``step``: applied updates so far; ``epoch``: global samples so far / training set size;
``wall_s``: training wall seconds (evaluation and checkpoint writing excluded);
``loss``/``train_accuracy``: over every rank's micro-batches since the previous record;
``test_accuracy``/``test_loss``: when this record's step evaluated, else null;
``global_samples``: samples covered by the latest update; ``samples_per_s``: the
training samples every rank computed since the previous record, each over its own
training seconds, summed over ranks (not the agreed progress, which lags under
asynchronous solvers); ``busy``,
``comm``, ``idle``: fractions of each rank's time since the previous record (see
:mod:`mpisolve.train.accounting`).

With ``--tensorboard DIR``, rank 0 also writes each record as TensorBoard scalars
(:class:`TensorBoardLog`).
"""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path
from typing import Any, TextIO

from ..errors import InputError
from .checkpoint import atomic_write


class RunLog:
    """Rank 0's JSON Lines file of records.

    On resume the file is kept up to the resumed step (records a crashed run wrote after
    its last checkpoint are dropped) and continued.
    """

    def __init__(self, path: str | Path, *, resume_step: int | None = None) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            kept = self._records_up_to(resume_step) if resume_step is not None else []
            self._file: TextIO = open(self.path, "w", encoding="utf-8")
        except OSError as err:
            raise InputError(f"cannot write the log {self.path}: {err.strerror}") from None
        for record in kept:
            self.write(record)

    def _records_up_to(self, step: int) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [r for r in read_records(self.path) if r.get("step", 0) <= step]

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardLog:
    """Rank 0's TensorBoard scalars: each record's numbers, tagged with their JSON Lines names.

    A record's ``step`` is the scalars' step. Every number of the record is a scalar of
    the same name (``loss``, ``train_accuracy``, ``test_accuracy`` when evaluated,
    ``samples_per_s``, ``epoch``, ``wall_s``, ...); the per-rank lists ``busy``,
    ``comm``, ``idle`` are written as their mean over ranks, and ``skipped_steps`` as its
    sum. On resume, scalars past the resumed step (written by the run that crashed) are
    hidden, as :class:`RunLog` drops its records.
    """

    def __init__(self, directory: str | Path, *, resume_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise InputError("--tensorboard needs tensorboard: pip install 'mpisolve[tensorboard]'") from None
        purge_step = None if resume_step is None else resume_step + 1
        try:
            self._writer = SummaryWriter(log_dir=str(directory), purge_step=purge_step)
        except OSError as err:
            raise InputError(f"cannot write TensorBoard logs in {directory}: {err.strerror}") from None

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key == "step" or value is None:
                continue
            if isinstance(value, list):
                value = sum(value) if key == "skipped_steps" else sum(value) / max(len(value), 1)
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON Lines log (a torn last line, from a crash, is skipped)."""
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    continue
    except OSError as err:
        raise InputError(f"cannot read the log {path}: {err.strerror}") from None
    return records


def summary_path(log: str | Path) -> Path:
    """Where the summary of the run logging to ``log`` goes: ``run.jsonl`` -> ``run.summary.json``."""
    log = Path(log)
    return log.with_name(log.name.removesuffix(".jsonl") + ".summary.json")


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, [json.dumps(data, indent=2).encode() + b"\n"])


def versions() -> dict[str, str]:
    """Versions of Python and of the packages a run depends on."""
    import numpy
    import torch

    from .. import __version__
    from ..comm.communicator import mpi4py_version

    return {
        "python": platform.python_version(),
        "mpisolve": __version__,
        "torch": torch.__version__,
        "mpi4py": mpi4py_version(),
        "numpy": numpy.__version__,
    }


def git_commit() -> str | None:
    """The commit of mpisolve's source checkout (``-dirty`` when files differ from it), or None."""
    source = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=source, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "")


def run_facts(library_version: str) -> dict[str, Any]:
    """What a summary records about the software a run used."""
    return {"mpi_library_version": library_version, "versions": versions(), "git_commit": git_commit()}
