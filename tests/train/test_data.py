"""The built-in data sets and the per-rank shard streams."""

import subprocess
import sys

import pytest
import torch

from mpisolve.errors import InputError
from mpisolve.train.data import ShardStream, eval_shard, load_dataset, synthetic_images


def one_pass(stream):
    """The indices of the stream's next full pass over its shard."""
    n = len(stream.indices)
    seen = []
    while len(seen) < n:
        stream.next_batch()
        seen += stream.last_indices.tolist()
    return seen[:n], seen[n:]


def test_digits_has_a_held_out_test_split():
    data = load_dataset("digits")
    assert data.in_shape == (1, 8, 8) and data.classes == 10
    assert len(data.train) + len(data.test) == 1797 and len(data.test) == 359
    assert set(data.test.y.tolist()) == set(range(10))
    assert abs(data.train.x.mean().item()) < 1e-5 and abs(data.train.x.std().item() - 1) < 1e-4


def test_digits_are_scikit_learns_without_importing_it():
    """Every rank loads the digits at start-up: importing scikit-learn would cost each about a second."""
    from sklearn.datasets import load_digits

    from mpisolve.train.data import _digits

    digits = load_digits()
    x, y = _digits()
    assert torch.equal(x, torch.from_numpy(digits.images).float().unsqueeze(1))
    assert torch.equal(y, torch.from_numpy(digits.target).long())
    check = (
        "import sys; from mpisolve.train.data import load_dataset; load_dataset('digits'); "
        "print('sklearn' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True).stdout == "False\n"


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_every_pass_covers_the_training_set_once_across_ranks(size):
    data = load_dataset("digits")
    first, second = [], []
    for rank in range(size):
        stream = ShardStream(data.train, rank=rank, size=size, seed=3, batch_size=7)
        pass0, spill = one_pass(stream)
        rest, _ = one_pass(stream)
        pass1 = spill + rest
        assert pass1[: len(pass0)] != pass0  # reshuffled between passes
        first += pass0
        second += pass1[: len(pass0)]
    assert sorted(first) == list(range(len(data.train)))  # nothing missed, nothing twice
    assert sorted(second) == list(range(len(data.train)))


def test_batches_are_the_indexed_examples_and_depend_on_the_seed():
    data = load_dataset("digits")
    stream = ShardStream(data.train, rank=0, size=2, seed=0, batch_size=5)
    x, y = stream.next_batch()
    assert torch.equal(x, data.train.x[stream.last_indices]) and torch.equal(y, data.train.y[stream.last_indices])
    other = ShardStream(data.train, rank=0, size=2, seed=1, batch_size=5)
    assert not torch.equal(other.indices, stream.indices)


def test_stream_resumes_from_its_state():
    data = load_dataset("digits")
    a = ShardStream(data.train, rank=1, size=3, seed=0, batch_size=64)
    for _ in range(12):  # past the end of the first pass
        a.next_batch()
    b = ShardStream(data.train, rank=1, size=3, seed=0, batch_size=64)
    b.load_state_dict(a.state_dict())
    for _ in range(3):
        a.next_batch()
        b.next_batch()
        assert torch.equal(a.last_indices, b.last_indices)
    with pytest.raises(InputError, match="data shard has"):
        ShardStream(data.train, rank=1, size=2, seed=0, batch_size=64).load_state_dict(a.state_dict())


def test_synthetic_is_deterministic_cifar_shaped_and_not_trivial():
    x, y = synthetic_images(1200)
    x2, y2 = synthetic_images(1200)
    assert x.shape == (1200, 3, 32, 32) and torch.equal(x, x2) and torch.equal(y, y2)
    assert set(y.tolist()) == set(range(10))
    # Nearest class mean on raw pixels: well above chance (learnable), far from perfect.
    train, test = slice(0, 1000), slice(1000, 1200)
    means = torch.stack([x[train][y[train] == c].mean(0) for c in range(10)]).flatten(1)
    pred = torch.cdist(x[test].flatten(1), means).argmin(1)
    accuracy = (pred == y[test]).float().mean().item()
    assert 0.2 < accuracy < 0.9, accuracy
    data = load_dataset("synthetic", size=500)
    assert data.in_shape == (3, 32, 32) and len(data.test) == 100
    with pytest.raises(InputError, match="at least 100"):
        synthetic_images(50)


def test_test_shards_partition_the_test_split():
    data = load_dataset("digits")
    parts = [eval_shard(data.test, r, 4) for r in range(4)]
    assert sum(len(p) for p in parts) == len(data.test)
    assert torch.equal(torch.cat([p.y for p in parts]), data.test.y)


def test_a_resized_stream_keeps_its_place_and_grows_its_buffers_only():
    data = load_dataset("digits")
    whole = ShardStream(data.train, rank=0, size=2, seed=0, batch_size=12)
    resized = ShardStream(data.train, rank=0, size=2, seed=0, batch_size=7)
    expected = whole.next_batch()[1].tolist()
    drawn = resized.next_batch()[1].tolist()
    buffer = resized.last_indices.data_ptr()
    resized.resize(5)
    x, y = resized.next_batch()
    drawn += y.tolist()
    assert drawn == expected  # the same stream, cut at another size
    assert y.shape == (5,) and torch.equal(x, data.train.x[resized.last_indices])
    assert resized.last_indices.data_ptr() == buffer  # a smaller size views the buffer it has
    resized.resize(9)
    assert resized.next_batch()[1].shape == (9,)
