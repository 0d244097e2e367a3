"""The user's data and models: CIFAR-10 from disk, image folders, factories, torchvision; their errors."""

from __future__ import annotations

import pickle
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from mpisolve.errors import InputError
from mpisolve.train.data import DatasetSplit, ShardStream, TensorSplit, eval_shard, load_dataset
from mpisolve.train.datasets import IMAGENET_MEAN, IMAGENET_STD
from mpisolve.train.models import build_model, check_model_spec, model_for

from .userdata import MODULE, write_cifar10, write_image_folder, write_module


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """The test module of user code, importable for this test only."""
    write_module(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield MODULE
    sys.modules.pop(MODULE, None)


# ----------------------------------------------------------------------- CIFAR-10
def test_cifar10_reads_the_python_version_and_normalises_per_channel(tmp_path):
    written = write_cifar10(tmp_path, per_batch=6, test=7)
    data = load_dataset(f"cifar10:{written['folder']}")
    assert data.classes == 10 and data.in_shape == (3, 32, 32)
    assert len(data.train) == 30 and len(data.test) == 7
    assert data.train.dtype == torch.float32
    # The oracle: the written rows, laid out as CIFAR-10 documents them, normalised with
    # numpy's per-channel statistics of the training pixels.
    pixels = written["train_data"].reshape(-1, 3, 1024).astype(np.float64)
    mean, std = pixels.mean(axis=(0, 2)), pixels.std(axis=(0, 2))
    x, y = data.train.take(torch.tensor([0, 13, 29]))
    for row, i in enumerate((0, 13, 29)):
        expected = (written["train_data"][i].reshape(3, 32, 32) - mean[:, None, None]) / std[:, None, None]
        np.testing.assert_allclose(x[row].numpy(), expected, rtol=1e-5, atol=1e-5)
        assert y[row].item() == written["train_labels"][i]
    red_of_pixel_2_5 = written["test_data"][3][0 * 1024 + 2 * 32 + 5]
    assert data.test.take(torch.tensor([3]))[0][0, 0, 2, 5].item() == pytest.approx(
        (red_of_pixel_2_5 - mean[0]) / std[0]
    )
    # The directory holding cifar-10-batches-py is taken too (torchvision's root).
    assert len(load_dataset(f"cifar10:{tmp_path}").train) == 30


def test_cifar10_batches_stream_through_the_shards(tmp_path):
    written = write_cifar10(tmp_path, per_batch=6, test=7)
    data = load_dataset(f"cifar10:{written['folder']}")
    stream = ShardStream(data.train, rank=1, size=2, seed=0, batch_size=4)
    for _ in range(5):  # past the end of the 15-example shard
        x, y = stream.next_batch()
        expected, labels = data.train.take(stream.last_indices)
        assert torch.equal(x, expected) and torch.equal(y, labels)
        assert torch.equal(y, torch.from_numpy(written["train_labels"][stream.last_indices.numpy()]))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("missing_folder", "is not a directory"),
        ("empty_folder", "holds none of CIFAR-10's files"),
        ("missing_file", "lacks data_batch_3"),
        ("not_a_pickle", "data_batch_2 is not a CIFAR-10 batch"),
        ("wrong_shape", "b'data' must be a uint8 array of N x 3072"),
        ("bad_label", "labels must lie in [0, 10)"),
        ("code", "test_batch is not a CIFAR-10 batch (UnpicklingError: it refers to posix.system)"),
    ],
)
def test_cifar10_problems_name_the_file(tmp_path, damage, message):
    folder = write_cifar10(tmp_path / "data")["folder"]
    spec = f"cifar10:{folder}"
    if damage == "missing_folder":
        spec = f"cifar10:{tmp_path / 'nowhere'}"
    elif damage == "empty_folder":
        spec = f"cifar10:{tmp_path}"
    elif damage == "missing_file":
        (folder / "data_batch_3").unlink()
    elif damage == "not_a_pickle":
        (folder / "data_batch_2").write_bytes(b"\x00 not a pickle")
    elif damage == "wrong_shape":
        with open(folder / "data_batch_4", "wb") as f:
            pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, f, protocol=2)
    elif damage == "bad_label":
        with open(folder / "data_batch_1", "wb") as f:
            pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, f, protocol=2)
    elif damage == "code":
        marker = tmp_path / "ran"

        class Payload:
            def __reduce__(self):
                import os

                return os.system, (f"touch {marker}",)

        with open(folder / "test_batch", "wb") as f:
            pickle.dump({b"data": Payload()}, f, protocol=2)
    with pytest.raises(InputError) as err:
        load_dataset(spec)
    assert message in str(err.value) and str(err.value).startswith("cifar10: ")
    if damage == "code":
        assert not (tmp_path / "ran").exists()  # the unpickler never called it


# ------------------------------------------------------------------- image folder
def test_image_folder_decodes_each_image_as_documented(tmp_path):
    written = write_image_folder(tmp_path, size=12)
    data = load_dataset(f"imagefolder:{tmp_path}", image_size=12)
    assert data.classes == 3 and data.in_shape == (3, 12, 12)
    assert len(data.train) == 12 and len(data.test) == 6  # notes.txt ignored
    mean, std = np.array(IMAGENET_MEAN)[:, None, None], np.array(IMAGENET_STD)[:, None, None]
    x, y = data.train.take(torch.arange(12))
    assert y.tolist() == [0] * 4 + [1] * 4 + [2] * 4  # classes sorted, files sorted
    for name, c in (("cat", 0), ("dog", 1), ("eel", 2)):
        for j in range(4):
            expected = (written["train"][name][j].transpose(2, 0, 1) / 255.0 - mean) / std  # no resize at this size
            np.testing.assert_allclose(x[4 * c + j].numpy(), expected, rtol=1e-5, atol=1e-5)
    x, y = data.test.take(torch.arange(6))
    assert y.tolist() == [0, 0, 1, 1, 2, 2]


def test_image_folder_resizes_the_shorter_side_then_crops_the_centre(tmp_path):
    from PIL import Image

    for side in ("train", "val"):  # val/ stands in for test/
        (tmp_path / side / "only").mkdir(parents=True)
    wide = np.zeros((8, 16, 3), np.uint8)  # left quarter red, middle half green, right quarter blue
    wide[:, :4, 0], wide[:, 4:12, 1], wide[:, 12:, 2] = 255, 255, 255
    Image.fromarray(wide).save(tmp_path / "train" / "only" / "wide.png")
    Image.fromarray(np.full((40, 20, 3), 200, np.uint8)).save(tmp_path / "val" / "only" / "tall.png")
    data = load_dataset(f"imagefolder:{tmp_path}", image_size=8)
    x = data.train.take(torch.tensor([0]))[0][0] * torch.tensor(IMAGENET_STD).view(3, 1, 1)
    x += torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    expected = wide[:, 4:12].transpose(2, 0, 1) / 255.0  # shorter side already 8: the middle 8 columns
    np.testing.assert_allclose(x.numpy(), expected, atol=1e-5)
    tall = data.test.take(torch.tensor([0]))[0][0] * torch.tensor(IMAGENET_STD).view(3, 1, 1)
    tall += torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    assert tall.shape == (3, 8, 8) and torch.allclose(tall, torch.full_like(tall, 200 / 255), atol=1e-5)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("no_train", "has no train/ folder"),
        ("no_test", "has no test/ or val/ folder"),
        ("extra_class", "has classes that"),
        ("no_images", "no images in"),
    ],
)
def test_image_folder_layout_problems(tmp_path, damage, message):
    write_image_folder(tmp_path)
    if damage == "no_train":
        (tmp_path / "train").rename(tmp_path / "training")
    elif damage == "no_test":
        (tmp_path / "test").rename(tmp_path / "testing")
    elif damage == "extra_class":
        (tmp_path / "test" / "fox").mkdir()
    elif damage == "no_images":
        for png in (tmp_path / "test").rglob("*.png"):
            png.unlink()
    with pytest.raises(InputError, match=message):
        load_dataset(f"imagefolder:{tmp_path}", image_size=12)


def test_an_undecodable_image_names_its_file(tmp_path):
    write_image_folder(tmp_path)
    broken = tmp_path / "train" / "dog" / "001.png"
    broken.write_bytes(b"not a png at all")
    data = load_dataset(f"imagefolder:{tmp_path}", image_size=12)
    with pytest.raises(InputError, match=f"imagefolder: cannot decode {broken}"):
        data.train.take(torch.tensor([5]))


# ----------------------------------------------------------------------- factories
def test_a_dataset_split_streams_the_same_batches_as_the_same_tensors():
    """The sharding and seeding contract does not depend on how a split holds its examples."""
    data = load_dataset("digits")
    as_tensors = data.train
    as_dataset = DatasetSplit.of(TensorDataset(as_tensors.x, as_tensors.y), what="digits", classes=10)
    for rank in range(3):
        a = ShardStream(as_tensors, rank=rank, size=3, seed=4, batch_size=50)
        b = ShardStream(as_dataset, rank=rank, size=3, seed=4, batch_size=50)
        for _ in range(12):  # more than a pass of the 479-example shard
            xa, ya = a.next_batch()
            xb, yb = b.next_batch()
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    test = DatasetSplit.of(TensorDataset(data.test.x, data.test.y), what="test", classes=10)
    for rank in range(3):
        assert torch.equal(eval_shard(test, rank, 3).rows(0, 5)[0], eval_shard(data.test, rank, 3).rows(0, 5)[0])


def test_factory_data_and_model(user_module):
    data = load_dataset(f"{user_module}:make_data")
    assert data.classes == 4 and data.in_shape == (3, 6, 6)  # classes counted from the labels
    assert len(data.train) == 64 and len(data.test) == 32
    model = model_for(f"{user_module}:make_model", data, seed=0)
    assert model[1].in_features == 3 * 6 * 6 and model[3].out_features == 4  # it got in_shape and classes
    assert model.training  # the check's forward pass in eval mode leaves it in training mode
    digits = load_dataset(f"{user_module}:digits_data")
    assert digits.classes == 10 and digits.in_shape == (1, 8, 8)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module:make", "--dataset no_such_module:make: cannot import no_such_module: ModuleNotFoundError"),
        ("{m}:absent", "--dataset {m}:absent: {m} has no attribute 'absent'"),
        ("{m}:NOT_CALLABLE", "--dataset {m}:NOT_CALLABLE: NOT_CALLABLE is a int, not a callable"),
        ("{m}:broken_data", "the factory returned a list; expected (train, test) or (train, test, classes)"),
        ("{m}:two_numbers", "the training set is a int, not a map-style torch Dataset"),
        ("{m}:raising_data", "the factory raised RuntimeError: no data here (at tiny_user_code.py:"),
        ("{m}:make_model", "the factory requires in_shape, classes; mpisolve gives no arguments"),
        ("cifar10:", "give the path, cifar10:PATH"),
        ("mnist", "unknown dataset 'mnist'"),
    ],
)
def test_factory_dataset_problems(user_module, spec, message):
    with pytest.raises(InputError) as err:
        load_dataset(spec.format(m=user_module))
    assert message.format(m=user_module) in str(err.value)


@pytest.mark.parametrize(
    ("train", "message"),
    [
        (TensorDataset(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long)), "the training set is empty"),
        ([(torch.zeros(2), 0), (torch.zeros(3), 1)], "[1] has shape (3,), the first example (2,)"),
        ([("text", 0)], "[0]: x is a str, not a tensor"),
        ([(torch.zeros(2), 1.5)], "[0]: y is float 1.5, not a class index"),
        ([(torch.zeros(2), 7)], "[0]: label 7 is not a class index in [0, 2)"),
        ([torch.zeros(2)], "[0] is a Tensor, not an (x, y) pair"),
    ],
)
def test_examples_that_do_not_fit_are_named(train, message):
    with pytest.raises(InputError) as err:
        split = DatasetSplit.of(train, what="the training set", classes=2)
        split.take(torch.arange(len(split)))
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("vgg", "unknown model 'vgg' (give mlp, cnn, resnet18, torchvision:NAME or MODULE:FACTORY)"),
        ("torchvision:", "unknown model 'torchvision:'"),
        ("{m}:not_a_model", "--model {m}:not_a_model: the factory returned a str, not a torch.nn.Module"),
        ("{m}:wrong_output", "gives (2, 11) on a batch of 2 from digits; expected logits of shape (2, 10)"),
        ("no_such_module:make", "cannot import no_such_module"),
    ],
)
def test_model_problems(user_module, spec, message):
    with pytest.raises(InputError) as err:
        model_for(spec.format(m=user_module), load_dataset("digits"), seed=0)
    assert message.format(m=user_module) in str(err.value)


def test_the_model_factory_gets_only_the_arguments_it_names(tmp_path, monkeypatch):
    (tmp_path / "shapes.py").write_text(
        "from torch import nn\n"
        "def by_classes(classes): return nn.Linear(4, classes)\n"
        "def by_keywords(**given): return nn.Linear(given['in_shape'][0], given['classes'])\n"
        "def nothing(): return nn.Linear(4, 2)\n"
        "def too_much(in_shape, classes, width): return nn.Linear(4, 2)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert build_model("shapes:by_classes", (4,), 3).out_features == 3
    assert build_model("shapes:by_keywords", (5,), 6).in_features == 5
    assert build_model("shapes:nothing", (4,), 2).out_features == 2
    with pytest.raises(InputError, match="requires width; mpisolve gives in_shape, classes"):
        build_model("shapes:too_much", (4,), 2)
    sys.modules.pop("shapes", None)


def test_torchvision_missing_or_broken_is_one_clear_line(monkeypatch, tmp_path):
    check_model_spec("torchvision:resnet18")  # the form is fine without torchvision
    monkeypatch.setitem(sys.modules, "torchvision", None)  # as if it were not installed
    with pytest.raises(
        InputError, match=r"--model torchvision:resnet18 needs torchvision: pip install 'mpisolve\[vision\]'"
    ):
        build_model("torchvision:resnet18", (3, 32, 32), 10)
    # A torchvision built for another torch fails as it imports (its C++ operators do not register).
    monkeypatch.delitem(sys.modules, "torchvision")
    broken = tmp_path / "torchvision"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(InputError, match="torchvision does not import .RuntimeError: operator torchvision::nms"):
        build_model("torchvision:resnet18", (3, 32, 32), 10)
    sys.modules.pop("torchvision", None)


def test_torchvision_model_by_name():
    try:
        import torchvision.models  # noqa: F401
    except Exception as err:  # absent, or built for another torch (no CPU build on some wheel paths)
        pytest.skip(f"torchvision does not import here: {type(err).__name__}: {err}")
    data = load_dataset("synthetic", size=100)
    model = model_for("torchvision:resnet18", data, seed=0)
    assert model.fc.out_features == 10
    with pytest.raises(InputError, match="unknown torchvision model 'resnet_nine'"):
        build_model("torchvision:resnet_nine", (3, 32, 32), 10)


def test_tensor_split_rows_are_views_and_parts_slice():
    x, y = torch.randn(10, 2), torch.arange(10)
    split = TensorSplit(x, y)
    rows = split.rows(2, 5)[0]
    assert rows.data_ptr() == x[2].data_ptr()  # evaluation copies nothing
    assert torch.equal(split.part(3, 7).rows(0, 4)[1], y[3:7])
