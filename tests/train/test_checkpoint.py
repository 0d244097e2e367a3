"""Checkpoint files and directories: atomic writes, and refusal of what cannot be resumed."""

import json
import signal
import subprocess
import sys

import pytest
import torch

from mpisolve.errors import CheckpointError
from mpisolve.train.checkpoint import MANIFEST, CheckpointDir, read_file, write_file

STATE = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 4, "rng": (3, (1, 2), None), "name": "x"}
IDENTITY = {"model": "mlp", "model_signature": "abc", "dataset": "digits", "solver": "allreduce"}


def test_roundtrip_and_no_temporary_left(tmp_path):
    path = tmp_path / "a.ckpt"
    write_file(path, {"step": 4}, STATE)
    header, state = read_file(path)
    assert header["step"] == 4 and header["payload_bytes"] > 0
    assert torch.equal(state["model"]["w"], STATE["model"]["w"]) and state["rng"] == STATE["rng"]
    assert [p.name for p in tmp_path.iterdir()] == ["a.ckpt"]


def test_truncated_corrupt_and_foreign_files_are_refused(tmp_path):
    path = tmp_path / "a.ckpt"
    write_file(path, {}, STATE)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="is truncated"):
        read_file(path)
    path.write_bytes(data[:30])
    with pytest.raises(CheckpointError, match="damaged header"):
        read_file(path)
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF
    path.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read_file(path)
    torch.save(STATE, path)  # a plain torch file is not an mpisolve checkpoint
    with pytest.raises(CheckpointError, match="not an mpisolve checkpoint"):
        read_file(path)


def write_generation(directory, step, size):
    for rank in range(size):
        CheckpointDir(directory, rank=rank, size=size).write_rank(step, IDENTITY, {"rank": rank, "step": step})
    CheckpointDir(directory, rank=0, size=size).commit(step)
    for rank in range(size):
        CheckpointDir(directory, rank=rank, size=size).prune(step)


def test_directory_generations(tmp_path):
    write_generation(tmp_path, 5, 2)
    write_generation(tmp_path, 9, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        MANIFEST,
        "step-00000009-rank-00000.ckpt",
        "step-00000009-rank-00001.ckpt",
    ]
    step, state = CheckpointDir(tmp_path, rank=1, size=2).read_rank(IDENTITY)
    assert step == 9 and state == {"rank": 1, "step": 9}


def test_other_world_size_model_or_missing_checkpoint_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        CheckpointDir(tmp_path, rank=0, size=2).read_rank(IDENTITY)
    write_generation(tmp_path, 5, 2)
    with pytest.raises(CheckpointError, match="written by 2 ranks; this run has 4"):
        CheckpointDir(tmp_path, rank=0, size=4).read_rank(IDENTITY)
    with pytest.raises(CheckpointError, match="is of model 'mlp'; this run has 'cnn'"):
        CheckpointDir(tmp_path, rank=0, size=2).read_rank(dict(IDENTITY, model="cnn"))
    (tmp_path / MANIFEST).write_text(json.dumps({"something": "else"}))
    with pytest.raises(CheckpointError, match="not an mpisolve checkpoint manifest"):
        CheckpointDir(tmp_path, rank=0, size=2).read_rank(IDENTITY)


WRITER = """
import sys, time
from pathlib import Path
import torch
from mpisolve.train.checkpoint import MAGIC, atomic_write, write_file

path = Path(sys.argv[1])
write_file(path, {"step": 1}, {"generation": 1, "w": torch.ones(1000)})

def slow_chunks():
    yield MAGIC
    yield b'{"step": 2, "payload_bytes": 4000000}\\n'
    yield bytes(1000000)
    print("mid-write", flush=True)
    time.sleep(60)
    yield bytes(3000000)

atomic_write(path, slow_chunks())
"""


def test_writer_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "a.ckpt"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "mid-write\n"
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    finally:
        if writer.poll() is None:
            writer.kill()
    assert writer.returncode == -signal.SIGKILL
    assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir())  # the unfinished write, never renamed
    header, state = read_file(path)
    assert header["step"] == 1 and state["generation"] == 1 and torch.equal(state["w"], torch.ones(1000))
