"""Data sets for Horovod's examples/pytorch, generated here (perf/horovod_examples.sh).

The examples read MNIST (torchvision's ``MNIST``, which downloads unless its raw files are
there) and ImageNet (``ImageFolder`` trees); this machine fetches neither. This writes
small stand-ins in the layouts the examples read: MNIST's idx files under
``DIR/MNIST/raw`` (what torchvision checks before downloading), and ImageNet's ``train``
and ``validation`` ImageFolders of JPEGs. Each class is a fixed pattern plus noise, so a
model that learns shows it in its accuracy.

    python perf/horovod_examples_data.py mnist DIR [--train N] [--test N]
    python perf/horovod_examples_data.py imagenet DIR [--classes C] [--per-class N] [--size S]
"""

import argparse
import struct
from pathlib import Path

import numpy as np
from PIL import Image


def _patterns(classes: int, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """One pattern per class: a bright square at a class's own place on a dark field."""
    height, width = shape[:2]
    side = max(2, min(height, width) // 4)
    patterns = np.zeros((classes, *shape), dtype=np.float32)
    for c in range(classes):
        top = int(rng.integers(0, height - side))
        left = int(rng.integers(0, width - side))
        patterns[c, top : top + side, left : left + side] = 1.0
    return patterns


def _images(patterns: np.ndarray, count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``count`` uint8 images (a class's pattern plus noise) and their labels."""
    labels = rng.integers(0, len(patterns), size=count)
    noise = rng.uniform(0.0, 0.5, size=(count, *patterns.shape[1:]))
    pixels = np.clip(0.7 * patterns[labels] + noise, 0.0, 1.0)
    return (pixels * 255).astype(np.uint8), labels.astype(np.uint8)


def mnist(root: Path, train: int, test: int, seed: int) -> None:
    """MNIST's four idx files (uncompressed), 28x28 images of 10 classes."""
    rng = np.random.default_rng(seed)
    patterns = _patterns(10, (28, 28), rng)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", train), ("t10k", test)):
        images, labels = _images(patterns, count, rng)
        # idx format: big-endian magic (0x0803 images, 0x0801 labels), then the dimensions.
        with open(raw / f"{split}-images-idx3-ubyte", "wb") as f:
            f.write(struct.pack(">IIII", 0x0803, count, 28, 28) + images.tobytes())
        with open(raw / f"{split}-labels-idx1-ubyte", "wb") as f:
            f.write(struct.pack(">II", 0x0801, count) + labels.tobytes())


def imagenet(root: Path, classes: int, per_class: int, size: int, seed: int) -> None:
    """``root/{train,validation}/class<c>/<i>.jpg``: RGB JPEGs, ``size`` pixels a side."""
    rng = np.random.default_rng(seed)
    patterns = _patterns(classes, (size, size, 3), rng)
    for split in ("train", "validation"):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True, exist_ok=True)
            images, _ = _images(patterns[c : c + 1], per_class, rng)
            for i, image in enumerate(images):
                Image.fromarray(image).save(folder / f"{i}.jpg", quality=90)


def main() -> None:
    """Parse the command line and write the data set asked for."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("mnist", "imagenet"))
    parser.add_argument("dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=1280, help="MNIST training images")
    parser.add_argument("--test", type=int, default=256, help="MNIST test images")
    parser.add_argument("--classes", type=int, default=2, help="ImageNet classes")
    parser.add_argument("--per-class", type=int, default=8, help="ImageNet images a class and split")
    parser.add_argument("--size", type=int, default=64, help="ImageNet image side, pixels")
    args = parser.parse_args()
    if args.kind == "mnist":
        mnist(args.dir, args.train, args.test, args.seed)
    else:
        imagenet(args.dir, args.classes, args.per_class, args.size, args.seed)


if __name__ == "__main__":
    main()
