"""perf/horovod_examples_data.py: the data sets Horovod's examples read, in their layouts."""

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

SCRIPT = Path(__file__).resolve().parents[2] / "perf" / "horovod_examples_data.py"


def _idx(path: Path, magic: int, dims: int) -> np.ndarray:
    """An idx file's array, read by its header (big-endian magic and dimensions)."""
    data = path.read_bytes()
    head = struct.unpack(f">{1 + dims}I", data[: 4 * (1 + dims)])
    assert head[0] == magic
    return np.frombuffer(data[4 * (1 + dims) :], dtype=np.uint8).reshape(head[1:])


def test_mnist_layout(tmp_path: Path) -> None:
    """The four uncompressed idx files under MNIST/raw, labels 0-9, one pattern a class."""
    subprocess.run([sys.executable, SCRIPT, "mnist", tmp_path, "--train", "200", "--test", "50"], check=True)
    raw = tmp_path / "MNIST" / "raw"
    for split, count in (("train", 200), ("t10k", 50)):
        images = _idx(raw / f"{split}-images-idx3-ubyte", 0x0803, 3)
        labels = _idx(raw / f"{split}-labels-idx1-ubyte", 0x0801, 1)
        assert images.shape == (count, 28, 28) and labels.shape == (count,)
        assert labels.max() <= 9
    images = _idx(raw / "train-images-idx3-ubyte", 0x0803, 3).astype(float)
    labels = _idx(raw / "train-labels-idx1-ubyte", 0x0801, 1)
    # A class's images share its pattern: nearer their class mean than another class's.
    means = {c: images[labels == c].mean(axis=0) for c in np.unique(labels)}
    nearest = [min(means, key=lambda c: float(((image - means[c]) ** 2).sum())) for image in images]
    assert np.mean(np.array(nearest) == labels) > 0.9


def test_imagenet_layout(tmp_path: Path) -> None:
    """train/ and validation/ ImageFolders: a folder a class, RGB JPEGs of the size asked."""
    subprocess.run(
        [sys.executable, SCRIPT, "imagenet", tmp_path, "--classes", "3", "--per-class", "2", "--size", "32"],
        check=True,
    )
    for split in ("train", "validation"):
        folders = sorted(p.name for p in (tmp_path / split).iterdir())
        assert folders == ["class0", "class1", "class2"]
        for folder in folders:
            files = sorted((tmp_path / split / folder).glob("*.jpg"))
            assert len(files) == 2
            with Image.open(files[0]) as image:
                assert image.format == "JPEG" and image.mode == "RGB" and image.size == (32, 32)
