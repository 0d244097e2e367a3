"""mpisolve.horovod against oracles that share none of its code: one process on the whole
batch (plain torch), torch's BatchNorm on the whole batch, numpy; at 2 and 3 ranks."""

import json

import numpy as np
import pytest
import torch

import mpisolve.horovod as hvd

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.ranks(2, 3)]


@pytest.fixture(scope="module", autouse=True)
def started():
    hvd.init()


def whole_batch(size, steps=3, rows=4):
    """Every rank's batches, made alike on every rank."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(size * rows, 5, generator=g), torch.randn(size * rows, 2, generator=g)) for _ in range(steps)]


def model_and_reference():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    reference = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    reference.load_state_dict(model.state_dict())
    return model, reference


@pytest.mark.parametrize(
    "options",
    [{}, {"backward_passes_per_step": 2}, {"compression": hvd.Compression.fp16}, {"op": hvd.Sum}],
    ids=["buckets", "two-passes", "fp16-per-tensor", "sum"],
)
def test_distributed_optimizer_steps_as_one_process_on_the_whole_batch(options):
    size, rank = hvd.size(), hvd.rank()
    model, reference = model_and_reference()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), named_parameters=model.named_parameters(), **options
    )
    assert isinstance(optimizer, torch.optim.SGD)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    passes = options.get("backward_passes_per_step", 1)
    scale = size if options.get("op") == hvd.Sum else 1  # a sum of the ranks' mean gradients
    for x, y in whole_batch(size, rows=4 * passes):
        optimizer.zero_grad()
        mine = [(x[r::size], y[r::size]) for r in [rank]][0]
        for xs, ys in zip(mine[0].chunk(passes), mine[1].chunk(passes)):
            (torch.nn.functional.mse_loss(model(xs), ys) / passes).backward()
        optimizer.step()
        plain.zero_grad()
        (torch.nn.functional.mse_loss(reference(x), y) * scale).backward()
        plain.step()
    tol = 2e-3 if "compression" in options else 1e-5
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_synchronize_then_clip_then_step_without_a_second_reduction():
    model, reference = model_and_reference()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    x, y = whole_batch(hvd.size(), steps=1)[0]
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x[hvd.rank() :: hvd.size()]), y[hvd.rank() :: hvd.size()]).backward()
    optimizer.synchronize()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    with optimizer.skip_synchronize():
        optimizer.step()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    assert abs(norm - torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)) < 1e-4 * norm
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_gradients_of_the_collectives_are_horovods():
    size, rank = hvd.size(), hvd.rank()
    x = torch.full((rank + 1, 3), float(rank), requires_grad=True)
    gathered = hvd.allgather(x)
    weights = torch.arange(gathered.numel(), dtype=torch.float32).view_as(gathered)
    (gathered * weights).sum().backward()  # every rank's weights alike: the averaged gradient is them
    start = sum(r + 1 for r in range(rank))
    np.testing.assert_array_equal(x.grad.numpy(), weights[start : start + rank + 1].numpy())

    t = torch.arange(2.0 * size, requires_grad=True)
    out = hvd.reducescatter(t, op=hvd.Sum)
    (out * (rank + 1)).sum().backward()  # d/dt of sum_r (r+1) * sum_q t_q[rows of r]
    np.testing.assert_array_equal(t.grad.numpy(), np.repeat(np.arange(1, size + 1), 2) * size)

    b = torch.ones(4, requires_grad=True)
    hvd.broadcast(b, root_rank=size - 1).sum().backward()
    assert b.grad.tolist() == ([1.0] * 4 if rank == size - 1 else [0.0] * 4)

    a = torch.arange(float(size), requires_grad=True)
    received, splits = hvd.alltoall(a, splits=torch.ones(size, dtype=torch.int32))
    (received * torch.arange(1.0, size + 1)).sum().backward()  # rank r's element went to every rank's slot r
    assert splits.tolist() == [1] * size and a.grad.tolist() == [float(rank + 1)] * size


def test_mismatches_raise_horovods_error_on_every_rank_and_nothing_hangs():
    with pytest.raises(hvd.HorovodInternalError, match="the ranks. shapes, dtypes"):
        hvd.allreduce(torch.zeros(2 + hvd.rank()))
    with pytest.raises(hvd.HorovodInternalError, match="roots differ"):
        hvd.broadcast(torch.zeros(2), root_rank=hvd.rank())
    first = hvd.allreduce_async(torch.zeros(1), name="twice")
    with pytest.raises(ValueError, match="already in flight"):
        hvd.allreduce_async(torch.zeros(1), name="twice")
    hvd.synchronize(first)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size()


def test_join_answers_allreduces_and_returns_the_last_rank():
    size, rank = hvd.size(), hvd.rank()
    if rank == 0:
        last = hvd.join()
    else:
        got = hvd.allreduce(torch.full((3,), 6.0), op=hvd.Average)
        assert got.tolist() == [6.0 * (size - 1) / size] * 3  # rank 0 gave zeros, the average is over all
        last = hvd.join()
    assert last == size - 1


def test_sync_batch_norm_is_batch_norm_on_the_whole_batch():
    size, rank = hvd.size(), hvd.rank()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2 * size, 3, 4, generator=g)
    mine = x[2 * rank : 2 * rank + 2].clone().requires_grad_()
    whole = x.clone().requires_grad_()
    sync, plain = hvd.SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    out, ref = sync(mine), plain(whole)
    torch.testing.assert_close(out, ref[2 * rank : 2 * rank + 2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sync.running_mean, plain.running_mean)
    torch.testing.assert_close(sync.running_var, plain.running_var)
    weights = torch.randn(ref.shape, generator=g)
    (out * weights[2 * rank : 2 * rank + 2]).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(mine.grad, whole.grad[2 * rank : 2 * rank + 2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hvd.allreduce(sync.weight.grad, op=hvd.Sum), plain.weight.grad, rtol=1e-5, atol=1e-5)


def test_process_sets_and_the_state_broadcasts(monkeypatch):
    size, rank = hvd.size(), hvd.rank()
    with pytest.raises(ValueError, match="HOROVOD_DYNAMIC_PROCESS_SETS"):
        hvd.add_process_set([0])
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    evens, odds = hvd.add_process_set(range(0, size, 2)), hvd.add_process_set(range(1, size, 2))
    mine = evens if rank % 2 == 0 else odds
    assert mine.included() and mine.ranks == list(range(rank % 2, size, 2))
    assert hvd.allreduce(torch.tensor([rank]), op=hvd.Sum, process_set=mine).item() == sum(mine.ranks)
    assert hvd.broadcast(torch.tensor([rank]), root_rank=mine.ranks[-1], process_set=mine).item() == mine.ranks[-1]
    assert hvd.remove_process_set(odds) and hvd.remove_process_set(evens)

    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=size - 1)
    hvd.broadcast_optimizer_state(optimizer, root_rank=size - 1)
    everyone = hvd.allgather(
        torch.cat([model.weight.detach().reshape(1, -1), optimizer.state[model.weight]["exp_avg"].reshape(1, -1)], 1)
    )
    assert (everyone == everyone[-1]).all()
    assert optimizer.param_groups[0]["lr"] == 0.01 * size
    assert hvd.broadcast_object({"rank": rank}, root_rank=size - 1) == {"rank": size - 1}
    assert hvd.allgather_object(rank) == list(range(size))


def test_timeline_records_each_named_collective(tmp_path, monkeypatch):
    path = hvd.broadcast_object(str(tmp_path / "timeline.json"))
    hvd.start_timeline(path)
    hvd.allreduce(torch.ones(3), name="loss")
    hvd.allgather(torch.ones(1))
    hvd.stop_timeline()
    if hvd.rank() == 0:
        events = json.loads(open(path).read())
        names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
        assert {"allreduce.loss", "allgather"} <= names
        spans = [e["name"] for e in events if e.get("ph") == "B"]
        assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "ALLGATHER"} <= set(spans)
        assert events[0]["name"] == "start_time_since_epoch_in_micros"
