"""The built-in data sets and each rank's endless, reshuffled stream over its own shard.

Two data sets, both available offline and identical on every rank:

- ``digits``: scikit-learn's 1797 handwritten digits (1x8x8, 10 classes), standardised.
- ``synthetic``: a deterministic CIFAR-shaped set (3x32x32, 10 classes) of ``size``
  examples: each image is a randomly shifted, randomly scaled class template, plus a
  shifted template of another class as a distractor, a colour cast and strong pixel
  noise: learnable, not trivial (what simple baselines and the built-in models reach on
  it: docs/guide/cli.md, "Data").

A fixed fifth of each set (chosen with a fixed seed, whatever ``--seed`` is) is held out
as the test split. The training split is cut into one disjoint shard per rank, chosen
from the run's seed; each rank draws micro-batches from its own shard endlessly, in a
new order on every pass, so ranks that compute different numbers of micro-batches
(ABS-SGD, asynchronous solvers) never wait on each other for data.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..options import InputError

DATASETS = ("digits", "synthetic")

#: Fraction of every data set held out for testing.
TEST_FRACTION = 0.2
#: The held-out split and the synthetic images do not depend on the run's seed.
SPLIT_SEED = 0
SYNTHETIC_SEED = 20240601
SYNTHETIC_MIN_SIZE = 100


@dataclass(frozen=True)
class Split:
    """Images ``x`` (N, C, H, W) float32 and labels ``y`` (N,) int64."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return self.y.shape[0]


@dataclass(frozen=True)
class DataSet:
    name: str
    train: Split
    test: Split
    classes: int

    @property
    def in_shape(self) -> tuple[int, ...]:
        return tuple(self.train.x.shape[1:])


def load_dataset(name: str, *, size: int = 6000) -> DataSet:
    """The data set ``name`` with its held-out test split; ``size`` is the synthetic set's total."""
    if name == "digits":
        x, y = _digits()
    elif name == "synthetic":
        x, y = synthetic_images(size)
    else:
        raise InputError(f"unknown dataset {name!r} (known: {', '.join(DATASETS)})")
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = int(round(TEST_FRACTION * len(y)))
    test, train = order[:n_test], order[n_test:]
    x_train = x[train]
    mean, std = x_train.mean(), x_train.std()  # standardise with training statistics only
    return DataSet(
        name,
        Split(((x_train - mean) / std).contiguous(), y[train].contiguous()),
        Split(((x[test] - mean) / std).contiguous(), y[test].contiguous()),
        classes=10,
    )


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
        self._x_buffer = torch.empty((0, *split.x.shape[1:]), dtype=split.x.dtype)
        self._y_buffer = torch.empty(0, dtype=split.y.dtype)
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
            self._x_buffer = torch.empty((batch_size, *self.split.x.shape[1:]), dtype=self.split.x.dtype)
            self._y_buffer = torch.empty(batch_size, dtype=self.split.y.dtype)
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
        torch.index_select(self.split.x, 0, self.last_indices, out=self._x)
        torch.index_select(self.split.y, 0, self.last_indices, out=self._y)
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
    return Split(split.x[lo:hi], split.y[lo:hi])
