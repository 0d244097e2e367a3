"""Tiny user data on disk for the tests: a CIFAR-10 directory, an image folder, a Python module.

Each writer returns what it wrote (the pixels and labels as numpy arrays), so that tests
check what mpisolve reads against the values themselves, not against mpisolve's code.
"""

from __future__ import annotations

import pickle
import textwrap
from pathlib import Path

import numpy as np

#: The module :func:`write_module` writes: a model factory and data set factories.
MODULE = "tiny_user_code"


def write_cifar10(root: Path, *, per_batch: int = 8, test: int = 10, classes: int = 10, seed: int = 0) -> dict:
    """A CIFAR-10 python-version directory ``root/cifar-10-batches-py`` in the real format:
    pickled dicts (protocol 2) with ``b"data"`` (N x 3072 uint8) and ``b"labels"``, five
    training batches, ``test_batch`` and ``batches.meta``. Returns the arrays written."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    written: dict = {"train_data": [], "train_labels": []}
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        n = test if name == "test_batch" else per_batch
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, classes, size=n)]
        batch = {b"batch_label": name.encode(), b"labels": labels, b"data": data, b"filenames": [b"x.png"] * n}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)
        if name == "test_batch":
            written["test_data"], written["test_labels"] = data, np.array(labels)
        else:
            written["train_data"].append(data)
            written["train_labels"].append(np.array(labels))
    meta = {b"label_names": [f"class{c}".encode() for c in range(classes)], b"num_vis": 3072}
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump(meta, f, protocol=2)
    written["train_data"] = np.concatenate(written["train_data"])
    written["train_labels"] = np.concatenate(written["train_labels"])
    written["folder"] = folder
    return written


def write_image_folder(
    root: Path,
    *,
    classes: tuple[str, ...] = ("cat", "dog", "eel"),
    per_class: int = 4,
    size: int = 12,
    test: str = "test",
) -> dict[str, dict[str, list[np.ndarray]]]:
    """``root/train/<class>/*.png`` and ``root/<test>/<class>/*.png``: random RGB PNGs of
    ``size`` x ``size``, plus a file that is not an image (to be ignored). Returns the pixels."""
    from PIL import Image

    rng = np.random.default_rng(1)
    written: dict[str, dict[str, list[np.ndarray]]] = {}
    for side in ("train", test):
        written[side] = {}
        for name in classes:
            folder = root / side / name
            folder.mkdir(parents=True)
            (folder / "notes.txt").write_text("not an image")
            written[side][name] = []
            for i in range(per_class if side == "train" else 2):
                pixels = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i:03d}.png")
                written[side][name].append(pixels)
    return written


def write_module(folder: Path) -> Path:
    """A module of user code in ``folder``: ``make_model(in_shape, classes)``, ``make_data()``
    (random 3x6x6 images in 4 classes, TensorDatasets), ``digits_data()`` (mpisolve's digits
    split as TensorDatasets), and broken factories for the error tests."""
    path = folder / f"{MODULE}.py"
    path.write_text(
        textwrap.dedent(
            """
            import math

            import torch
            from torch import nn
            from torch.utils.data import TensorDataset

            NOT_CALLABLE = 42


            def make_model(in_shape, classes):
                features = math.prod(in_shape)
                return nn.Sequential(nn.Flatten(), nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, classes))


            def make_data():
                g = torch.Generator().manual_seed(5)
                x = torch.randn(96, 3, 6, 6, generator=g)
                y = torch.randint(0, 4, (96,), generator=g)
                x += y.view(-1, 1, 1, 1).float()  # learnable
                return TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])


            def digits_data():
                from mpisolve.train.data import load_dataset

                data = load_dataset("digits")
                return TensorDataset(data.train.x, data.train.y), TensorDataset(data.test.x, data.test.y), 10


            def not_a_model(in_shape):
                return "a string"


            def wrong_output(classes):
                return nn.Sequential(nn.Flatten(), nn.LazyLinear(classes + 1))


            def broken_data():
                return [1, 2, 3, 4]


            def two_numbers():
                return 1, 2


            def raising_data():
                raise RuntimeError("no data here")
            """
        )
    )
    return path
