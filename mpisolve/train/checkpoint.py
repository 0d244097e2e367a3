"""Checkpoints: every rank's full training state, written atomically, verified when read.

Layout of a checkpoint directory::

    latest.json                        the manifest: step, world size, one file per rank
    step-00000120-rank-00000.ckpt      rank 0's state at update 120
    step-00000120-rank-00001.ckpt      ...

Each rank writes its own file (its model, optimizer and solver state, its position in
its data shard, its RNG states), then rank 0 replaces the manifest; a new generation
becomes the checkpoint only once every rank's file is complete, and the previous one is
deleted only after that. Every write goes to a temporary file that is flushed, fsynced
and renamed over the target, so a crash leaves the old file or the new one, never a
mix.

A rank file is ``MAGIC``, one line of JSON header (format, what the state is of, payload
length and SHA-256) and the payload (``torch.save`` of the state). Reading checks the
magic (a foreign file is refused), the length (a truncated file is refused), the checksum
(a corrupted one is refused), and that the checkpoint is of this run's model, data set,
solver and world size. Payloads are loaded with ``weights_only=True``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError

MAGIC = b"MPISOLVE-CHECKPOINT\n"
FORMAT = 1
MANIFEST = "latest.json"
_MAX_HEADER = 1 << 16


def atomic_write(path: Path, chunks: Iterable[bytes | memoryview]) -> None:
    """Write ``chunks`` to ``path`` so that readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


def write_file(path: Path, header: dict[str, Any], state: dict[str, Any]) -> None:
    """One rank's checkpoint file: magic, JSON header with length and checksum, payload."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()
    head = dict(header, format=FORMAT, payload_bytes=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    atomic_write(path, [MAGIC, json.dumps(head).encode() + b"\n", payload])


def read_file(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(header, state) of a checkpoint file, refusing foreign, truncated and corrupt files."""
    try:
        with open(path, "rb") as f:
            magic = f.read(len(MAGIC))
            if magic != MAGIC:
                raise CheckpointError(f"{path} is not an mpisolve checkpoint (no mpisolve header)")
            line = f.readline(_MAX_HEADER)
            payload = f.read()
    except OSError as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err.strerror}") from None
    try:
        header = json.loads(line)
        expected, digest = int(header["payload_bytes"]), str(header["sha256"])
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path} has a damaged header (truncated or corrupt)") from None
    if header.get("format") != FORMAT:
        raise CheckpointError(f"{path} is in checkpoint format {header.get('format')!r}; this mpisolve reads {FORMAT}")
    if len(payload) < expected:
        raise CheckpointError(f"{path} is truncated ({len(payload)} of {expected} payload bytes)")
    if len(payload) > expected or hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(f"{path} is corrupt (checksum mismatch)")
    state = torch.load(io.BytesIO(payload), weights_only=True)
    return header, state


def rank_file(step: int, rank: int) -> str:
    return f"step-{step:08d}-rank-{rank:05d}.ckpt"


class CheckpointDir:
    """One run's checkpoint directory, seen from one rank (``rank`` of ``size``)."""

    def __init__(self, path: str | Path, *, rank: int, size: int) -> None:
        self.path = Path(path)
        self.rank = rank
        self.size = size

    def write_rank(self, step: int, header: dict[str, Any], state: dict[str, Any]) -> None:
        """This rank's part of the checkpoint at ``step`` (call on every rank, then :meth:`commit`)."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            write_file(
                self.path / rank_file(step, self.rank),
                dict(header, rank=self.rank, world_size=self.size, step=step),
                state,
            )
        except OSError as err:
            raise CheckpointError(f"cannot write a checkpoint in {self.path}: {err.strerror}") from None

    def commit(self, step: int) -> None:
        """Rank 0, once every rank has written: make ``step`` the checkpoint to resume from."""
        manifest = {
            "mpisolve_checkpoint": FORMAT,
            "step": step,
            "world_size": self.size,
            "files": [rank_file(step, r) for r in range(self.size)],
        }
        try:
            atomic_write(self.path / MANIFEST, [json.dumps(manifest, indent=1).encode()])
        except OSError as err:
            raise CheckpointError(f"cannot write {self.path / MANIFEST}: {err.strerror}") from None

    def prune(self, step: int) -> None:
        """Delete this rank's files of generations older than the committed ``step``."""
        for old in self.path.glob(f"step-*-rank-{self.rank:05d}.ckpt"):
            if old.name != rank_file(step, self.rank):
                old.unlink(missing_ok=True)

    def read_rank(self, expect: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """(step, this rank's state) of the committed checkpoint, checked against ``expect``.

        ``expect`` holds what the checkpoint must be of (model, model signature, data
        set, solver); the world size and rank are checked as well.
        """
        manifest_path = self.path / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"no checkpoint to resume from in {self.path} ({MANIFEST} is missing)") from None
        except (OSError, ValueError):
            raise CheckpointError(f"{manifest_path} is not a readable mpisolve checkpoint manifest") from None
        if not isinstance(manifest, dict) or manifest.get("mpisolve_checkpoint") != FORMAT:
            raise CheckpointError(f"{manifest_path} is not an mpisolve checkpoint manifest (format {FORMAT})")
        if manifest.get("world_size") != self.size:
            raise CheckpointError(
                f"the checkpoint in {self.path} was written by {manifest.get('world_size')} ranks; "
                f"this run has {self.size} (resume with the same number of ranks)"
            )
        step = int(manifest["step"])
        header, state = read_file(self.path / manifest["files"][self.rank])
        if header.get("step") != step or header.get("rank") != self.rank or header.get("world_size") != self.size:
            raise CheckpointError(f"{self.path / manifest['files'][self.rank]} does not match {MANIFEST}")
        for key, want in expect.items():
            if header.get(key) != want:
                raise CheckpointError(
                    f"the checkpoint in {self.path} is of {key.replace('_', ' ')} {header.get(key)!r}; "
                    f"this run has {want!r}"
                )
        return step, state
