"""The user's data: CIFAR-10 from a local copy, a folder of images, a Python factory.

- ``cifar10:PATH``: the ``cifar-10-batches-py`` directory of CIFAR-10's "python
  version" (``data_batch_1`` .. ``data_batch_5``, ``test_batch``, ``batches.meta``;
  PATH may also be the directory holding it). Nothing is downloaded. Each batch file
  is a pickled dict with ``b"data"`` (N x 3072 uint8: 1024 red, 1024 green, 1024 blue
  values, rows of 32) and ``b"labels"`` (N ints); it is unpickled by an unpickler that
  builds numpy arrays and nothing else, so a file that is not a CIFAR batch cannot run
  code.
- ``imagefolder:PATH``: ``PATH/train/<class>/<image>`` and ``PATH/test/<class>/<image>``
  (or ``PATH/val/``), torchvision's ImageFolder layout. The classes are the folder
  names under ``train/``, sorted (their index is the label); images may sit in nested
  folders inside a class folder; files with other extensions are ignored. Each image is
  decoded with Pillow, converted to RGB, resized so that its shorter side is ``size``
  (bilinear), centre-cropped to ``size`` x ``size``, scaled to [0, 1] and normalised with
  ImageNet's per-channel mean and standard deviation (torchvision's convention). Images
  are decoded as batches are drawn: the folder never has to fit in memory.
- ``MODULE:FACTORY``: ``FACTORY()`` returns ``(train, test)`` or ``(train, test,
  classes)``: map-style torch Datasets (``len`` and ``[i]``) of ``(x, y)`` pairs, ``x`` a
  tensor (or numpy array) of one shape for every example, ``y`` a class index.

Every problem raises :class:`InputError` naming the file or the factory.
"""

from __future__ import annotations

import operator
import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
import torch.utils.data

from ..errors import InputError
from .factory import call, describe, load_callable

#: The files of CIFAR-10's python version.
CIFAR10_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_FILES = (*CIFAR10_TRAIN, "test_batch", "batches.meta")
CIFAR10_SHAPE = (3, 32, 32)

#: File name endings of the images an image folder holds (case ignored).
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp")
#: Per-channel mean and standard deviation every image folder's pixels are normalised with
#: (ImageNet's, as torchvision's pretrained models expect).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


# --------------------------------------------------------------------- CIFAR-10
def read_cifar10(path: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """CIFAR-10 from its python version: train pixels (N, 3, 32, 32) uint8, labels, test pixels, labels, classes."""
    root = Path(path).expanduser()
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    if not root.is_dir():
        raise InputError(
            f"cifar10: {path} is not a directory (give the cifar-10-batches-py directory of CIFAR-10's python version)"
        )
    missing = [name for name in CIFAR10_FILES if not (root / name).is_file()]
    if len(missing) == len(CIFAR10_FILES):
        raise InputError(
            f"cifar10: {root} holds none of CIFAR-10's files "
            "(give the cifar-10-batches-py directory of CIFAR-10's python version)"
        )
    if missing:
        raise InputError(
            f"cifar10: {root} lacks {', '.join(missing)} "
            "(CIFAR-10's python version has data_batch_1..data_batch_5, test_batch, batches.meta)"
        )
    meta = _unpickle(root / "batches.meta")
    names = meta.get(b"label_names")
    if not isinstance(names, list) or not names:
        raise InputError(f"cifar10: {root / 'batches.meta'} has no label_names list")
    classes = len(names)
    train = [_cifar_batch(root / name, classes) for name in CIFAR10_TRAIN]
    test_x, test_y = _cifar_batch(root / "test_batch", classes)
    return torch.cat([x for x, _ in train]), torch.cat([y for _, y in train]), test_x, test_y, classes


def _cifar_batch(path: Path, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    batch = _unpickle(path)
    data, labels = batch.get(b"data"), batch.get(b"labels")
    features = int(np.prod(CIFAR10_SHAPE))
    if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 2 and data.shape[1] == features):
        shape = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise InputError(f"cifar10: {path}: b'data' must be a uint8 array of N x {features}, got {shape}")
    if not isinstance(labels, list) or len(labels) != len(data) or not all(isinstance(v, int) for v in labels):
        raise InputError(f"cifar10: {path}: b'labels' must be a list of {len(data)} ints")
    y = torch.tensor(labels, dtype=torch.long)
    if len(y) and not (0 <= int(y.min()) and int(y.max()) < classes):
        raise InputError(f"cifar10: {path}: labels must lie in [0, {classes}), got {int(y.min())}..{int(y.max())}")
    return torch.from_numpy(data).view(-1, *CIFAR10_SHAPE), y


def _unpickle(path: Path) -> dict[Any, Any]:
    try:
        with open(path, "rb") as f:
            content = _ArrayUnpickler(f).load()
    except OSError as err:
        raise InputError(f"cifar10: cannot read {path}: {err.strerror}") from None
    except Exception as err:  # whatever a damaged or foreign pickle raises
        raise InputError(f"cifar10: {path} is not a CIFAR-10 batch ({describe(err)})") from None
    if not isinstance(content, dict):
        raise InputError(f"cifar10: {path} is not a CIFAR-10 batch (it holds a {type(content).__name__}, not a dict)")
    return content


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, bytes and numpy arrays; refuses every other global (no code runs)."""

    def __init__(self, file: BinaryIO) -> None:
        super().__init__(file, encoding="bytes")  # the files were pickled by Python 2

    def find_class(self, module: str, name: str) -> Any:
        if name == "_reconstruct" and module in ("numpy.core.multiarray", "numpy._core.multiarray"):
            return np.ndarray.__reduce__(np.empty(0))[0]  # numpy's array reconstructor, wherever it lives
        if (module, name) in (("numpy", "ndarray"), ("numpy", "dtype")):
            return getattr(np, name)
        if (module, name) == ("_codecs", "encode"):
            return _latin1_encode
        raise pickle.UnpicklingError(f"it refers to {module}.{name}")


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """What a Python 2 pickle's byte strings decode through (``_codecs.encode``), latin-1 only."""
    if encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"unexpected encoding {encoding!r}")
    return text.encode("latin1")


def channel_statistics(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and standard deviation of (N, C, ...) pixels, in float64 chunks (no full copy)."""
    channels = pixels.shape[1]
    total = torch.zeros(channels, dtype=torch.float64)
    squares = torch.zeros(channels, dtype=torch.float64)
    dims = [0, *range(2, pixels.dim())]
    for chunk in pixels.split(4096):
        values = chunk.to(torch.float64)
        total += values.sum(dims)
        squares += values.square().sum(dims)
    count = pixels.numel() / channels
    mean = total / count
    std = (squares / count - mean.square()).clamp_min(1e-12).sqrt()
    return mean.float(), std.float()


# ------------------------------------------------------------------ image folder
class ImageFolder(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """Image files and their labels, each decoded when it is read (see the module's docstring)."""

    def __init__(self, files: Sequence[tuple[Path, int]], classes: Sequence[str], size: int) -> None:
        self.files = list(files)
        self.classes = list(classes)
        self.size = size
        self._mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self._std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.files[index]
        return self.load(path), label

    def load(self, path: Path) -> torch.Tensor:
        """``path`` as a normalised (3, size, size) float32 tensor."""
        from PIL import Image

        size = self.size
        try:
            with Image.open(path) as image:
                image.draft("RGB", (size, size))  # JPEG: decode at the smallest scale that still covers size
                rgb = image.convert("RGB")
        except (OSError, ValueError, SyntaxError) as err:  # what Pillow raises for files it cannot decode
            raise InputError(f"imagefolder: cannot decode {path}: {err}") from None
        scale = size / min(rgb.size)
        width, height = (max(size, round(side * scale)) for side in rgb.size)
        rgb = rgb.resize((width, height), Image.Resampling.BILINEAR)
        left, top = (width - size) // 2, (height - size) // 2
        rgb = rgb.crop((left, top, left + size, top + size))
        x = torch.from_numpy(np.array(rgb, dtype=np.uint8)).permute(2, 0, 1).float().div_(255.0)
        return x.sub_(self._mean).div_(self._std)


def image_folders(path: str, size: int) -> tuple[ImageFolder, ImageFolder]:
    """The train and test image folders under ``path`` (listed the same way on every rank)."""
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise InputError("imagefolder needs Pillow: pip install pillow (it comes with 'mpisolve[train]')") from None
    root = Path(path).expanduser()
    if not root.is_dir():
        raise InputError(f"imagefolder: {path} is not a directory")
    layout = "train/ and test/ (or val/), each with one folder of images per class"
    train_dir = root / "train"
    test_dir = next((root / name for name in ("test", "val") if (root / name).is_dir()), None)
    if not train_dir.is_dir() or test_dir is None:
        lacking = "train/" if not train_dir.is_dir() else "test/ or val/"
        raise InputError(f"imagefolder: {root} has no {lacking} folder (expected {layout})")
    classes = _class_folders(train_dir)
    if not classes:
        raise InputError(f"imagefolder: {train_dir} has no class folders (expected {layout})")
    unknown = sorted(set(_class_folders(test_dir)) - set(classes))
    if unknown:
        raise InputError(f"imagefolder: {test_dir} has classes that {train_dir} lacks: {', '.join(unknown)}")
    folders = []
    for folder in (train_dir, test_dir):
        files = _image_files(folder, classes)
        if not files:
            raise InputError(f"imagefolder: no images in {folder} (looked for {', '.join(IMAGE_EXTENSIONS)})")
        folders.append(ImageFolder(files, classes, size))
    return folders[0], folders[1]


def _class_folders(folder: Path) -> list[str]:
    return sorted(entry.name for entry in os.scandir(folder) if entry.is_dir() and not entry.name.startswith("."))


def _image_files(folder: Path, classes: Sequence[str]) -> list[tuple[Path, int]]:
    """``(file, label)`` of every image under ``folder/<class>/``, in a sorted, reproducible order."""
    files = []
    for label, name in enumerate(classes):
        for directory, subdirectories, names in os.walk(folder / name, followlinks=True):
            subdirectories.sort()
            files += [(Path(directory) / f, label) for f in sorted(names) if f.lower().endswith(IMAGE_EXTENSIONS)]
    return files


# ---------------------------------------------------------------------- factory
def factory_datasets(spec: str) -> tuple[Any, Any, int | None]:
    """``(train, test, classes or None)`` from the user's ``MODULE:FACTORY``."""
    result = call(load_callable(spec, "--dataset"), spec, "--dataset", {})
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise InputError(
            f"--dataset {spec}: the factory returned a {type(result).__name__}; "
            "expected (train, test) or (train, test, classes)"
        )
    for side, dataset in zip(("training", "test"), result[:2]):
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise InputError(
                f"--dataset {spec}: the {side} set is a {type(dataset).__name__}, "
                "not a map-style torch Dataset (len, [i])"
            )
    classes = result[2] if len(result) == 3 else None
    if classes is not None and (not isinstance(classes, int) or isinstance(classes, bool) or classes < 1):
        raise InputError(f"--dataset {spec}: classes must be an int >= 1, got {classes!r}")
    return result[0], result[1], classes


def class_count(dataset: Any, what: str) -> int:
    """The classes of a Dataset: its ``classes`` (a count or the names), else the largest of its
    ``targets`` + 1, else the largest label + 1 (this last reads every example once)."""
    named = getattr(dataset, "classes", None)
    if isinstance(named, int) and not isinstance(named, bool):
        return named
    if isinstance(named, Sequence) and named:
        return len(named)
    targets = getattr(dataset, "targets", None)
    if targets is not None:
        labels = torch.as_tensor(targets)
    else:
        labels = torch.tensor([read_example(dataset, i, what)[1] for i in range(len(dataset))], dtype=torch.long)
    if labels.numel() == 0 or labels.is_floating_point() or int(labels.min()) < 0:
        raise InputError(f"{what}: cannot tell the number of classes from its labels (return it from the factory)")
    return int(labels.max()) + 1


def read_example(dataset: Any, index: int, what: str) -> tuple[torch.Tensor, int]:
    """``dataset[index]`` as ``(x, y)``: a tensor (a numpy array is taken as one) and a class index."""
    item = dataset[index]
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise InputError(f"{what}[{index}] is a {type(item).__name__}, not an (x, y) pair")
    x, y = item
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    if not isinstance(x, torch.Tensor):
        raise InputError(
            f"{what}[{index}]: x is a {type(x).__name__}, not a tensor "
            "(give the Dataset a transform that makes tensors, such as torchvision's ToTensor)"
        )
    try:
        label = operator.index(y)
    except TypeError:
        raise InputError(f"{what}[{index}]: y is {type(y).__name__} {y!r:.40}, not a class index") from None
    return x, label
