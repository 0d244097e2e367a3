"""The data sets (each side a :class:`Split`) and each rank's endless, reshuffled stream over its shard.

``--dataset`` names one of:

- ``digits``: scikit-learn's 1797 handwritten digits (1x8x8, 10 classes), standardised.
- ``synthetic``: a deterministic CIFAR-shaped set (3x32x32, 10 classes) of ``size``
  examples: each image is a randomly shifted, randomly scaled class template, plus a
  shifted template of another class as a distractor, a colour cast and strong pixel
  noise: learnable, not trivial (what simple baselines and the built-in models reach on
  it: docs/guide/cli.md, "Data").
- ``cifar10:PATH``, ``imagefolder:PATH``, ``MODULE:FACTORY``: the user's data
  (:mod:`mpisolve.train.datasets`), with its own test split.

Of the two built-in sets, a fixed fifth (chosen with a fixed seed, whatever ``--seed``
is) is held out as the test split. The training split is cut into one disjoint shard
per rank, chosen from the run's seed; each rank draws micro-batches from its own shard
endlessly, in a new order on every pass, so ranks that compute different numbers of
micro-batches (ABS-SGD, asynchronous solvers) never wait on each other for data. The
same contract holds whatever the split holds: tensors in memory (:class:`TensorSplit`:
the built-in sets, CIFAR-10 as uint8 pixels) or a torch Dataset read example by example
(:class:`DatasetSplit`: an image folder, the user's factory).
"""

from __future__ import annotations

import abc
import hashlib
import importlib.util
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InputError
from . import datasets
from .factory import describe, is_reference

#: The built-in data sets.
DATASETS = ("digits", "synthetic")
#: What ``--dataset`` takes, for help texts and errors.
DATASET_FORMS = "digits, synthetic, cifar10:PATH, imagefolder:PATH or MODULE:FACTORY"
#: Side, in pixels, of an image folder's images when ``--image-size`` is not given (torchvision's).
DEFAULT_IMAGE_SIZE = 224

#: Fraction of every data set held out for testing.
TEST_FRACTION = 0.2
#: The held-out split and the synthetic images do not depend on the run's seed.
SPLIT_SEED = 0
SYNTHETIC_SEED = 20240601
SYNTHETIC_MIN_SIZE = 100


class Split(abc.ABC):
    """One side of a data set: examples of one shape and dtype, each with a class label.

    The shard streams and evaluation read it only through :meth:`gather`, so every kind
    of split follows the same sharding, seeding and resuming contract.
    """

    #: One example's shape, e.g. (3, 32, 32), and the dtype batches have.
    example_shape: tuple[int, ...]
    dtype: torch.dtype

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def gather(self, indices: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        """Write examples ``indices`` into the rows of ``x`` and their labels into ``y``."""

    @abc.abstractmethod
    def part(self, start: int, stop: int) -> Split:
        """Examples ``start`` to ``stop`` (exclusive) as a split of their own."""

    def take(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Examples ``indices`` in new tensors ``(x, y)``."""
        x = torch.empty((len(indices), *self.example_shape), dtype=self.dtype)
        y = torch.empty(len(indices), dtype=torch.long)
        self.gather(indices, x, y)
        return x, y

    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Examples ``start`` to ``stop`` (exclusive), for evaluation."""
        return self.take(torch.arange(start, stop))


class TensorSplit(Split):
    """Examples held in memory: ``x`` (N, ...) and labels ``y`` (N,) int64.

    Without ``normalize``, batches are ``x``'s rows as they are. With ``normalize`` =
    (mean, std) per channel (dimension 1), ``x`` stays as stored (CIFAR-10's uint8 pixels,
    a quarter of float32's memory on every rank) and each batch is converted to float32
    and normalised as it is gathered.
    """

    def __init__(
        self, x: torch.Tensor, y: torch.Tensor, normalize: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        self.x, self.y, self.normalize = x, y, normalize
        self.example_shape = tuple(x.shape[1:])
        self.dtype = x.dtype if normalize is None else torch.float32
        if normalize is not None:
            per_channel = (-1, *[1] * (x.dim() - 2))
            self._mean, self._std = normalize[0].view(per_channel), normalize[1].view(per_channel)
            self._raw = torch.empty((0, *self.example_shape), dtype=x.dtype)  # grows to the largest batch

    def __len__(self) -> int:
        return self.y.shape[0]

    def gather(self, indices: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        torch.index_select(self.y, 0, indices, out=y)
        if self.normalize is None:
            torch.index_select(self.x, 0, indices, out=x)
            return
        if len(indices) > len(self._raw):
            self._raw = torch.empty((len(indices), *self.example_shape), dtype=self.x.dtype)
        raw = self._raw[: len(indices)]
        torch.index_select(self.x, 0, indices, out=raw)
        x.copy_(raw).sub_(self._mean).div_(self._std)

    def part(self, start: int, stop: int) -> TensorSplit:
        return TensorSplit(self.x[start:stop], self.y[start:stop], self.normalize)

    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.normalize is None:
            return self.x[start:stop], self.y[start:stop]  # views: nothing copied
        return super().rows(start, stop)


class DatasetSplit(Split):
    """Examples read one at a time from a map-style torch Dataset of ``(x, y)`` pairs.

    ``what`` names it in errors. An example of another shape than the first, or a label
    outside ``[0, classes)``, raises :class:`InputError` naming it.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        what: str,
        classes: int,
        start: int,
        stop: int,
        example_shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> None:
        self.dataset, self.what, self.classes = dataset, what, classes
        self.start, self.stop = start, stop
        self.example_shape, self.dtype = example_shape, dtype

    @classmethod
    def of(cls, dataset: Any, *, what: str, classes: int) -> DatasetSplit:
        """A split over all of ``dataset``, checked up front: a length, and a first example that reads."""
        try:
            size = len(dataset)
        except TypeError:
            raise InputError(f"{what} is a {type(dataset).__name__}, not a map-style Dataset (len, [i])") from None
        if size == 0:
            raise InputError(f"{what} is empty")
        split = cls(dataset, what=what, classes=classes, start=0, stop=size, example_shape=(), dtype=torch.float32)
        try:
            first, _ = split._example(0)
        except InputError:
            raise
        except Exception as err:  # the user's __getitem__
            raise InputError(f"{what}[0] cannot be read: {describe(err)}") from None
        split.example_shape, split.dtype = tuple(first.shape), first.dtype
        return split

    def __len__(self) -> int:
        return self.stop - self.start

    def _example(self, i: int) -> tuple[torch.Tensor, int]:
        index = self.start + i
        x, label = datasets.read_example(self.dataset, index, self.what)
        if not 0 <= label < self.classes:
            raise InputError(f"{self.what}[{index}]: label {label} is not a class index in [0, {self.classes})")
        return x, label

    def gather(self, indices: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        for row, i in enumerate(indices.tolist()):
            example, label = self._example(i)
            if example.shape != x.shape[1:]:
                raise InputError(
                    f"{self.what}[{self.start + i}] has shape {tuple(example.shape)}, the first example "
                    f"{self.example_shape}: every example must have one shape"
                )
            x[row].copy_(example)
            y[row] = label

    def part(self, start: int, stop: int) -> DatasetSplit:
        return DatasetSplit(
            self.dataset,
            what=self.what,
            classes=self.classes,
            start=self.start + start,
            stop=self.start + stop,
            example_shape=self.example_shape,
            dtype=self.dtype,
        )


@dataclass(frozen=True)
class DataSet:
    name: str
    train: Split
    test: Split
    classes: int

    @property
    def in_shape(self) -> tuple[int, ...]:
        return self.train.example_shape


def parse_dataset(spec: str) -> tuple[str, str]:
    """``(kind, argument)`` of a ``--dataset`` value: ``("cifar10", PATH)``, ``("factory", spec)``, ..."""
    if spec in DATASETS:
        return spec, ""
    kind, sep, argument = spec.partition(":")
    if sep and kind in ("cifar10", "imagefolder"):
        if not argument:
            raise InputError(f"dataset {spec!r}: give the path, {kind}:PATH")
        return kind, argument
    if is_reference(spec):
        return "factory", spec
    raise InputError(f"unknown dataset {spec!r} (give {DATASET_FORMS})")


def load_dataset(spec: str, *, size: int = 6000, image_size: int | None = None) -> DataSet:
    """The data set ``spec`` names (see :data:`DATASET_FORMS`) with its test split.

    ``size`` is the synthetic set's total; ``image_size`` the side of an image folder's
    images (default :data:`DEFAULT_IMAGE_SIZE`).
    """
    kind, argument = parse_dataset(spec)
    if kind == "cifar10":
        train_x, train_y, test_x, test_y, classes = datasets.read_cifar10(argument)
        stats = datasets.channel_statistics(train_x)  # standardise with training statistics only
        return DataSet(spec, TensorSplit(train_x, train_y, stats), TensorSplit(test_x, test_y, stats), classes)
    if kind == "imagefolder":
        folders = datasets.image_folders(argument, DEFAULT_IMAGE_SIZE if image_size is None else image_size)
        classes = len(folders[0].classes)
        return DataSet(
            spec,
            DatasetSplit.of(folders[0], what=f"imagefolder {argument}/train", classes=classes),
            DatasetSplit.of(folders[1], what=f"imagefolder {argument}/test", classes=classes),
            classes,
        )
    if kind == "factory":
        return _factory_dataset(spec)
    x, y = _digits() if kind == "digits" else synthetic_images(size)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = int(round(TEST_FRACTION * len(y)))
    test, train = order[:n_test], order[n_test:]
    x_train = x[train]
    mean, std = x_train.mean(), x_train.std()  # standardise with training statistics only
    return DataSet(
        spec,
        TensorSplit(((x_train - mean) / std).contiguous(), y[train].contiguous()),
        TensorSplit(((x[test] - mean) / std).contiguous(), y[test].contiguous()),
        classes=10,
    )


def _factory_dataset(spec: str) -> DataSet:
    train, test, classes = datasets.factory_datasets(spec)
    what = f"--dataset {spec}: the training set"
    if classes is None:
        try:
            classes = datasets.class_count(train, what)
        except InputError:
            raise
        except Exception as err:  # the user's Dataset
            raise InputError(f"{what}: cannot count its classes: {describe(err)}") from None
    train_split = DatasetSplit.of(train, what=what, classes=classes)
    test_split = DatasetSplit.of(test, what=f"--dataset {spec}: the test set", classes=classes)
    if test_split.example_shape != train_split.example_shape:
        raise InputError(
            f"--dataset {spec}: test examples have shape {test_split.example_shape}, "
            f"training examples {train_split.example_shape}"
        )
    return DataSet(spec, train_split, test_split, classes)


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits, read from the file its ``load_digits`` reads.

    Importing scikit-learn costs every rank about a second of CPU at start-up; reading its
    CSV (64 pixels and the label per row) directly does not.
    """
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is None or not path.is_file():
        raise InputError("dataset 'digits' needs scikit-learn: pip install 'mpisolve[train]'")
    rows = torch.from_numpy(np.loadtxt(path, delimiter=",", dtype=np.float32))
    x = rows[:, :-1].reshape(-1, 1, 8, 8).contiguous()  # (1797, 1, 8, 8), values 0..16
    return x, rows[:, -1].long()


def synthetic_images(size: int, *, noise: float = 2.5, shift: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` deterministic 3x32x32 images in 10 classes (the same on every machine and rank)."""
    if size < SYNTHETIC_MIN_SIZE:
        raise InputError(f"the synthetic data set needs at least {SYNTHETIC_MIN_SIZE} examples, got {size}")
    g = torch.Generator().manual_seed(SYNTHETIC_SEED)
    low = torch.randn(10, 3, 6, 6, generator=g)
    templates = F.interpolate(low, size=(32, 32), mode="bicubic", align_corners=False)
    templates /= templates.flatten(1).std(1).view(10, 1, 1, 1)
    offsets = range(-shift, shift + 1)
    # Every class template under every shift: (10, shifts, 3, 32, 32), gathered per example.
    shifted = torch.stack([torch.roll(templates, (dy, dx), dims=(2, 3)) for dy in offsets for dx in offsets], 1)
    shifts = shifted.shape[1]
    y = torch.randint(0, 10, (size,), generator=g)
    distractor = (y + torch.randint(1, 10, (size,), generator=g)) % 10
    where = torch.randint(0, shifts, (size,), generator=g)
    where_distractor = torch.randint(0, shifts, (size,), generator=g)
    contrast = 0.4 + torch.rand(size, 1, 1, 1, generator=g)
    mix = torch.rand(size, 1, 1, 1, generator=g)
    x = contrast * shifted[y, where] + mix * shifted[distractor, where_distractor]
    x += 0.5 * torch.randn(size, 3, 1, 1, generator=g)
    x += noise * torch.randn(x.shape, generator=g)
    return x, y


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers, the same in every process (unlike ``hash``)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_everything(seed: int) -> None:
    """Seed torch's, numpy's and Python's global generators (a 63-bit ``seed`` is fine)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def shard_indices(n: int, rank: int, size: int, seed: int) -> torch.Tensor:
    """This rank's disjoint share of ``range(n)``: a seeded permutation cut into ``size`` parts."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(seed, n)))
    return torch.tensor_split(order, size)[rank].clone()


class ShardStream:
    """Micro-batches from one rank's shard, endlessly: one reshuffled pass after another.

    A batch that runs past the end of a pass continues into the next pass, so every
    batch is full and every pass visits each example of the shard exactly once. The
    order of pass ``p`` depends only on (seed, rank, p), so the stream resumes exactly
    from its position (pass, offset). Batches are written into buffers allocated once.
    """

    def __init__(self, split: Split, *, rank: int, size: int, seed: int, batch_size: int) -> None:
        if batch_size < 1:
            raise InputError(f"--batch-size must be >= 1, got {batch_size}")
        self.split = split
        self.rank = rank
        self.seed = seed
        self.indices = shard_indices(len(split), rank, size, seed)
        if len(self.indices) == 0:
            raise InputError(f"the training set ({len(split)} examples) is too small for {size} ranks")
        self.passes = 0
        self.offset = 0
        self._order = self._pass_order(0)
        self._x_buffer = torch.empty((0, *split.example_shape), dtype=split.dtype)
        self._y_buffer = torch.empty(0, dtype=torch.long)
        self._index_buffer = torch.empty(0, dtype=torch.long)
        self.resize(batch_size)

    def resize(self, batch_size: int) -> None:
        """Draw batches of ``batch_size`` from here on (the position in the stream is kept).

        The buffers only grow: a smaller size views the ones it has, so a batch size that
        changes as training goes (adaptive ABS-SGD) allocates nothing once it has peaked.
        """
        if batch_size < 1:
            raise InputError(f"the batch size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        if batch_size > len(self._y_buffer):
            self._x_buffer = torch.empty((batch_size, *self.split.example_shape), dtype=self.split.dtype)
            self._y_buffer = torch.empty(batch_size, dtype=torch.long)
            self._index_buffer = torch.empty(batch_size, dtype=torch.long)
        self._x, self._y = self._x_buffer[:batch_size], self._y_buffer[:batch_size]
        #: Training-set indices of the latest batch.
        self.last_indices = self._index_buffer[:batch_size]

    def _pass_order(self, p: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(derive_seed(self.seed, self.rank, p))
        return self.indices[torch.randperm(len(self.indices), generator=g)]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next micro-batch (views of reused buffers: valid until the next call)."""
        filled = 0
        while filled < self.batch_size:
            take = min(self.batch_size - filled, len(self._order) - self.offset)
            self.last_indices[filled : filled + take] = self._order[self.offset : self.offset + take]
            filled += take
            self.offset += take
            if self.offset == len(self._order):
                self.passes += 1
                self.offset = 0
                self._order = self._pass_order(self.passes)
        self.split.gather(self.last_indices, self._x, self._y)
        return self._x, self._y

    def state_dict(self) -> dict[str, Any]:
        return {"passes": self.passes, "offset": self.offset, "shard_size": len(self.indices)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["shard_size"] != len(self.indices):
            raise InputError(
                f"the checkpoint's data shard has {state['shard_size']} examples, this run's has {len(self.indices)}"
            )
        self.passes, self.offset = int(state["passes"]), int(state["offset"])
        self._order = self._pass_order(self.passes)


def eval_shard(split: Split, rank: int, size: int) -> Split:
    """This rank's contiguous share of the test split, for evaluation spread over ranks."""
    bounds = torch.linspace(0, len(split), size + 1).round().long().tolist()
    lo, hi = bounds[rank], bounds[rank + 1]
    return split.part(lo, hi)
