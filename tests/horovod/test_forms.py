"""Horovod's forms of each collective (one tensor or a group, starting or blocking, new
tensors or the inputs): Horovod's parameters, by position and by keyword, against numpy."""

import inspect

import numpy as np
import pytest
import torch

import mpisolve.horovod as hvd

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.ranks(2, 3)]

_SCALES = "prescale_factor postscale_factor"
_AFTER_NAME = f"op {_SCALES} process_set"  # allreduce's parameters after name (and compression)
_SCATTER_AFTER_NAME = f"op process_set {_SCALES}"  # reducescatter's
#: Horovod 0.28.1's parameters (horovod/torch/mpi_ops.py), in order.
HOROVODS = {
    "allreduce": f"tensor average name compression {_AFTER_NAME}",
    "allreduce_async": f"tensor average name {_AFTER_NAME}",
    "allreduce_async_": f"tensor average name {_AFTER_NAME}",
    "allreduce_": f"tensor average name {_AFTER_NAME}",
    "grouped_allreduce": f"tensors average name compression {_AFTER_NAME}",
    "grouped_allreduce_async": f"tensors average name {_AFTER_NAME}",
    "grouped_allreduce_async_": f"tensors average name {_AFTER_NAME}",
    "grouped_allreduce_": f"tensors average name {_AFTER_NAME}",
    "allgather": "tensor name process_set",
    "allgather_async": "tensor name process_set",
    "grouped_allgather": "tensors name process_set",
    "grouped_allgather_async": "tensors name process_set",
    "broadcast": "tensor root_rank name process_set",
    "broadcast_async": "tensor root_rank name process_set",
    "broadcast_async_": "tensor root_rank name process_set",
    "broadcast_": "tensor root_rank name process_set",
    "reducescatter": f"tensor name compression {_SCATTER_AFTER_NAME}",
    "reducescatter_async": f"tensor name {_SCATTER_AFTER_NAME}",
    "grouped_reducescatter": f"tensors name compression {_SCATTER_AFTER_NAME}",
    "grouped_reducescatter_async": f"tensors name {_SCATTER_AFTER_NAME}",
}


@pytest.fixture(scope="module", autouse=True)
def started():
    hvd.init()


@pytest.mark.parametrize("name", sorted(HOROVODS))
def test_each_form_has_horovods_name_and_parameters(name):
    form = getattr(hvd, name)
    assert form.__name__ == name
    assert list(inspect.signature(form).parameters) == HOROVODS[name].split()
    assert form.__doc__


def rows(rank, count=6):
    """Rank ``rank``'s tensor: known values, different on every rank."""
    return torch.arange(count * 2, dtype=torch.float64).reshape(count, 2) * (rank + 1)


def test_allreduce_forms_by_position_and_keyword():
    size, rank = hvd.size(), hvd.rank()
    mine = rows(rank)
    want = sum(rows(r).numpy() for r in range(size)) * 3.0 * 0.5  # a sum, prescaled by 3, postscaled by 0.5
    positional = (None, None, hvd.Sum, 3.0, 0.5, hvd.global_process_set)
    keywords = {"op": hvd.Sum, "prescale_factor": 3.0, "postscale_factor": 0.5}
    results = {
        "allreduce": hvd.allreduce(mine, None, None, hvd.Compression.none, *positional[2:]),
        "allreduce kw": hvd.allreduce(tensor=mine, **keywords),
        "allreduce_async": hvd.synchronize(hvd.allreduce_async(mine, *positional)),
        "allreduce_async kw": hvd.synchronize(hvd.allreduce_async(tensor=mine, **keywords)),
        "grouped_allreduce": hvd.grouped_allreduce([mine], **keywords)[0],
        "grouped_allreduce_async": hvd.synchronize(hvd.grouped_allreduce_async(tensors=[mine], **keywords))[0],
    }
    in_place = {
        "allreduce_": lambda t: hvd.allreduce_(t, *positional),
        "allreduce_ kw": lambda t: hvd.allreduce_(tensor=t, **keywords),
        "allreduce_async_": lambda t: hvd.synchronize(hvd.allreduce_async_(t, *positional)),
        "grouped_allreduce_": lambda t: hvd.grouped_allreduce_([t], *positional)[0],
        "grouped_allreduce_async_": lambda t: hvd.synchronize(hvd.grouped_allreduce_async_(tensors=[t], **keywords))[0],
    }
    for form, run in in_place.items():
        target = mine.clone()
        result = run(target)
        assert result is target, form
        results[form] = target
    np.testing.assert_allclose(mine.numpy(), rows(rank).numpy())  # the out-of-place forms left it alone
    for form, got in results.items():
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, err_msg=form)


def test_allgather_broadcast_reducescatter_forms():
    size, rank = hvd.size(), hvd.rank()
    mine = rows(rank, count=rank + 1)  # first dimensions differ
    gathered = np.concatenate([rows(r, count=r + 1).numpy() for r in range(size)])
    for got in (
        hvd.allgather(mine),
        hvd.allgather(tensor=mine, name="gather"),
        hvd.synchronize(hvd.allgather_async(mine, None, hvd.global_process_set)),
        hvd.grouped_allgather([mine])[0],
    ):
        np.testing.assert_allclose(got.numpy(), gathered)
    root = size - 1
    target = rows(rank)
    assert hvd.broadcast_(target, root, "bcast") is target
    np.testing.assert_allclose(target.numpy(), rows(root).numpy())
    got = hvd.synchronize(hvd.broadcast_async(tensor=rows(rank), root_rank=root))
    np.testing.assert_allclose(got.numpy(), rows(root).numpy())
    whole = torch.arange(size * 4, dtype=torch.float64).reshape(size * 2, 2) * (rank + 1)
    total = sum(torch.arange(size * 4, dtype=torch.float64).reshape(size * 2, 2).numpy() * (r + 1) for r in range(size))
    share = total[rank * 2 : rank * 2 + 2]
    np.testing.assert_allclose(hvd.reducescatter(whole, op=hvd.Sum).numpy(), share)
    np.testing.assert_allclose(hvd.synchronize(hvd.reducescatter_async(whole, None, hvd.Sum)).numpy(), share)
    np.testing.assert_allclose(hvd.reducescatter(tensor=whole).numpy(), share / size)
