"""The allreduce solver: N ranks on N shards equal one process on the whole batch."""

import pytest
import torch
from torch import nn

import mpisolve
from mpisolve.comm.communicator import Communicator
from mpisolve.errors import ModelMismatchError


class Net(nn.Module):
    def __init__(self, hidden=6):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.fc = nn.Linear(3 * 4 * 4, hidden)
        self.out = nn.Linear(hidden, 2)
        self.scale = nn.Parameter(torch.ones((), dtype=torch.float64))
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x):
        h = torch.relu(self.fc(torch.relu(self.conv(x)).flatten(1)))
        return self.out(h) * self.scale.float()


def batches(steps, size):
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(4 * size, 1, 6, 6, generator=g), torch.randint(0, 2, (4 * size,), generator=g))
        for _ in range(steps)
    ]


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4)
@pytest.mark.parametrize("bucket_mb", [25.0, 0.0002])
def test_matches_single_process_on_the_global_batch(bucket_mb):
    comm = Communicator()
    torch.manual_seed(comm.rank)  # different on every rank: construction must broadcast rank 0's
    model = Net()
    reference = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    solver = mpisolve.make_solver("allreduce", model, opt, comm=comm.comm, bucket_mb=bucket_mb)
    if bucket_mb < 1:
        assert len(solver.grads.buckets) > 2
    reference.load_state_dict(model.state_dict())  # now rank 0's init everywhere
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for x, y in batches(3, comm.size):
        shard = slice(comm.rank * 4, (comm.rank + 1) * 4)
        solver.zero_grad()
        loss_fn(model(x[shard]), y[shard]).backward()
        info = solver.step()
        assert info.applied and info.local_samples == 4 and info.global_samples == 4 * comm.size
        ref_opt.zero_grad()
        loss_fn(reference(x), y).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    solver.close()


@pytest.mark.mpi(min_size=2)
def test_construction_broadcasts_parameters_and_optimizer_state():
    comm = Communicator()
    torch.manual_seed(comm.rank)
    # 15 float32 elements before the float64 ones: their bytes are not 8-aligned when packed.
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(4, 3, dtype=torch.float64))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(2, 4)
    (model[0](x).sum() + model[1](x.double()).sum()).backward()
    opt.step()  # rank-dependent Adam state
    solver = mpisolve.make_solver("allreduce", model, opt, comm=comm.comm)
    flat = torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])
    state = torch.cat([opt.state[p]["exp_avg"].double().reshape(-1) for p in model.parameters()])
    for t in (flat, state):
        gathered = comm.comm.allgather(t.tolist())
        assert all(g == gathered[0] for g in gathered)
    solver.close()


@pytest.mark.mpi(min_size=2)
def test_user_zero_grad_to_none_still_works():
    comm = Communicator()
    torch.manual_seed(0)
    model = nn.Linear(3, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    solver = mpisolve.make_solver("allreduce", model, opt, comm=comm.comm)
    opt.zero_grad(set_to_none=True)
    before = model.weight.detach().clone()
    x = torch.full((1, 3), float(comm.rank + 1))
    model(x).sum().backward()
    solver.step()
    mean = sum(range(1, comm.size + 1)) / comm.size
    torch.testing.assert_close(model.weight.detach(), before - mean)
    solver.close()


@pytest.mark.mpi(min_size=2)
def test_mismatched_models_raise_on_every_rank():
    comm = Communicator()
    odd = comm.size - 1
    model = nn.Sequential(
        nn.Linear(3, 5 if comm.rank == odd else 4), nn.Linear(4, 2) if comm.rank != odd else nn.Linear(5, 2)
    )
    with pytest.raises(ModelMismatchError, match=rf"parameter 0 \('0.weight'\).*rank\(s\) {odd} have"):
        mpisolve.make_solver("allreduce", model, torch.optim.SGD(model.parameters(), lr=0.1), comm=comm.comm)


@pytest.mark.mpi(min_size=2)
def test_sample_count_is_exact_for_bfloat16_gradients():
    comm = Communicator()
    model = nn.Linear(2, 1).to(torch.bfloat16)
    solver = mpisolve.make_solver("allreduce", model, torch.optim.SGD(model.parameters(), lr=0.0), comm=comm.comm)
    solver.zero_grad()
    model(torch.ones(301 + comm.rank, 2, dtype=torch.bfloat16)).sum().backward()
    info = solver.step()
    assert info.global_samples == sum(301 + r for r in range(comm.size))
    solver.close()
