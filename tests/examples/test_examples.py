"""The scripts in examples/, run as a user runs them: ``mpiexec -n 2 python -m mpi4py examples/X.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).with_name("mpiexec")
RANKS = 2


def run(script: str, *args: str, timeout: float = 300) -> list[str]:
    cmd = [str(MPIEXEC), "-n", str(RANKS), sys.executable, "-m", "mpi4py", str(ROOT / "examples" / script), *args]
    env = {**os.environ, "MPISOLVE_TIMEOUT": "120", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout.splitlines()


def test_plain_loop_learns():
    lines = run("plain_loop.py", "--epochs", "3")
    accuracy = float(lines[-1].split()[-1])
    assert lines[-1].startswith("epoch 2") and accuracy > 0.8, lines


def test_plain_loop_with_a_local_step_solver():
    lines = run("plain_loop.py", "--epochs", "1", "--solver", "local-sgd")
    assert lines[-1].startswith("epoch 0"), lines


def test_accumulation_clipping_and_amp():
    lines = run("accumulate_clip_amp.py", "--steps", "30")
    first, last = float(lines[0].split()[3]), float(lines[-1].split()[2])
    assert lines[-1].startswith("final loss") and last < first, lines


def test_resnet_on_an_image_folder(tmp_path):
    """Two classes of PNGs (dark and bright noise) in a generated folder; small images, a few epochs."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for label, (low, high) in enumerate([(0, 120), (135, 255)]):
        folder = tmp_path / f"class{label}"
        folder.mkdir()
        for i in range(16):
            pixels = rng.integers(low, high, size=(16, 16, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{i}.png")
    epochs = 3
    lines = run("resnet_image_folder.py", str(tmp_path), "--epochs", str(epochs), "--size", "16", "--width", "8")
    by_epoch = [sorted(line for line in lines if f" epoch {e} " in line) for e in range(epochs)]
    assert all(len(e) == RANKS for e in by_epoch), lines
    # One model on every rank: the same evaluation and BatchNorm statistics everywhere.
    assert all(len({line.split(" ", 2)[2].rsplit(" train", 1)[0] for line in e}) == 1 for e in by_epoch), lines
    loss = [float(e[0].split()[-1]) for e in by_epoch]
    assert loss[-1] < loss[0], lines


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_every_example_is_tested(script):
    assert script in Path(__file__).read_text()


@pytest.mark.parametrize("flags", [["--fp16-allreduce"], ["--use-adasum"]], ids=["average-fp16", "adasum"])
def test_a_horovod_script_learns_with_only_its_import_changed(flags):
    lines = run("horovod_loop.py", "--epochs", "3", *flags)
    accuracy = float(lines[-1].split()[-1])
    assert lines[-1].startswith("epoch 2") and accuracy > 0.8, lines
