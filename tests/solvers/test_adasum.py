"""The adasum solver on real ranks against a single-process simulation of every rank."""

import pytest
import torch
from torch import nn

import mpisolve
from mpisolve.comm.adasum import _Message
from mpisolve.comm.communicator import Communicator
from mpisolve.comm.engine import TorchMessage
from tests.adasum_reference import tree


class Net(nn.Module):
    """float64 layers (so the comparison is tight) and one float32 tensor (a second bucket dtype)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, dtype=torch.float64)
        self.fc = nn.Linear(2 * 4 * 4, 5, dtype=torch.float64)
        self.out = nn.Linear(5, 2, dtype=torch.float64)
        self.scale = nn.Parameter(torch.ones(5))
        self.unused = nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x):
        h = torch.relu(self.fc(torch.relu(self.conv(x)).flatten(1)))
        # Adam's first step is +-lr per element, so two ranks' deltas of a small tensor can
        # cancel to float32 round-off, which Adasum amplifies (combining ~0 with v gives
        # v/2) and no float64 oracle reproduces; five elements make that unlikely.
        return self.out(h * self.scale.double())


def shard(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(3 + rank, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(
        0, 2, (3 + rank,), generator=g
    )


def combine(per_rank):
    """Adasum (the numpy reference) of each parameter's tensors across the simulated ranks."""
    return [
        torch.from_numpy(tree([r[i].detach().double().numpy() for r in per_rank]).reshape(per_rank[0][i].shape)).to(
            per_rank[0][i].dtype
        )
        for i in range(len(per_rank[0]))
    ]


def assert_close(name, got, expected):
    tol = 1e-6 if got.dtype == torch.float32 else 1e-8  # float32 rounding of `scale` reaches the float64 layers
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


def clone(model):
    """A copy of the model's current parameters (deepcopy would copy the solver's hook)."""
    twin = Net()
    twin.load_state_dict(model.state_dict())
    return twin


def make_adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.01)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4, 5)
@pytest.mark.parametrize("engine", ["mpi", "gloo"])
@pytest.mark.parametrize("bucket_mb", [25.0, 0.0003])
def test_delta_mode_with_adam_matches_a_simulation_of_every_rank(bucket_mb, engine):
    comm = Communicator(engine=engine)
    torch.manual_seed(comm.rank)  # construction must broadcast rank 0's model
    model = Net()
    solver = mpisolve.make_solver("adasum", model, make_adam(model), comm=comm, bucket_mb=bucket_mb)
    if bucket_mb < 1:
        assert len(solver.deltas.buckets) > 2
    # The simulation: one model and one Adam per rank, each stepping on its own shard
    # with its own state; p = start + adasum(p_r - start) after every step.
    sims = [clone(model) for _ in range(comm.size)]
    sim_opts = [make_adam(m) for m in sims]
    loss_fn = nn.CrossEntropyLoss()
    for step in range(3):
        x, y = shard(step, comm.rank)
        solver.zero_grad()
        loss_fn(model(x), y).backward()
        info = solver.step()
        assert info.applied and info.local_samples == 3 + comm.rank
        assert info.global_samples == sum(3 + r for r in range(comm.size))

        start = [p.detach().clone() for p in sims[0].parameters()]
        for r, (sim, opt) in enumerate(zip(sims, sim_opts)):
            opt.zero_grad()
            loss_fn(sim(shard(step, r)[0]), shard(step, r)[1]).backward()
            opt.step()
        deltas = combine([[p - s for p, s in zip(sim.parameters(), start)] for sim in sims])
        with torch.no_grad():
            for sim in sims:
                for p, s, d in zip(sim.parameters(), start, deltas):
                    p.copy_(s + d)
    for (name, p), q in zip(model.named_parameters(), sims[0].parameters()):
        assert_close(name, p, q)
    # The optimizer state stays local: this rank's Adam moments are its own simulation's.
    mine = sim_opts[comm.rank].state_dict()["state"]
    for index, state in solver.optimizer.state_dict()["state"].items():
        assert_close(f"exp_avg {index}", state["exp_avg"], mine[index]["exp_avg"])
    solver.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4, 5)
@pytest.mark.parametrize("engine", ["mpi", "gloo"])
def test_gradient_mode_combines_gradients_then_steps(engine):
    comm = Communicator(engine=engine)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    solver = mpisolve.make_solver("adasum", model, opt, comm=comm, mode="gradient", bucket_mb=0.0003)
    sim = clone(model)
    sim_opt = torch.optim.SGD(sim.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(3):
        x, y = shard(step, comm.rank)
        solver.zero_grad()
        loss_fn(model(x), y).backward()
        info = solver.step()
        assert info.global_samples == sum(3 + r for r in range(comm.size))

        grads = []
        for r in range(comm.size):
            sim.zero_grad()
            loss_fn(sim(shard(step, r)[0]), shard(step, r)[1]).backward()
            grads.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in sim.parameters()])
        for p, g in zip(sim.parameters(), combine(grads)):
            p.grad = g
        sim_opt.step()
    for (name, p), q in zip(model.named_parameters(), sim.parameters()):
        assert_close(name, p, q)
    solver.close()


def train_adasum(comm, mode):
    """Three Adam (delta) or SGD (gradient) steps of Adasum on ``comm``, several buckets: the parameters,
    and the pairwise messages of its reductions."""
    torch.manual_seed(comm.rank)  # construction broadcasts rank 0's model
    model = Net()
    optimizer = make_adam(model) if mode == "delta" else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    solver = mpisolve.make_solver("adasum", model, optimizer, comm=comm, mode=mode, bucket_mb=0.0003)
    reducer = solver.deltas.reducer if mode == "delta" else solver._reducer
    messages = [
        op
        for reduction in reducer.reductions.values()
        for stage in reduction.stages
        for op in stage.operations
        if isinstance(op, (TorchMessage, _Message))
    ]
    loss_fn = nn.CrossEntropyLoss()
    for step in range(3):
        x, y = shard(step, comm.rank)
        solver.zero_grad()
        loss_fn(model(x), y).backward()
        solver.step()
    solver.close()
    return torch.cat([p.detach().double().reshape(-1) for p in model.parameters()]), messages


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4)
@pytest.mark.parametrize("mode", ["delta", "gradient"])
def test_pairwise_steps_through_the_gloo_engine_equal_mpis(mode):
    # The engine code NCCL runs for device tensors, through gloo's sends and receives on the CPU.
    mpi, through_mpi = train_adasum(Communicator(engine="mpi", node_shm=False), mode)  # its message path
    gloo, through_gloo = train_adasum(Communicator(engine="gloo"), mode)
    assert through_mpi and all(isinstance(op, _Message) for op in through_mpi)
    assert len(through_gloo) == len(through_mpi) and all(isinstance(op, TorchMessage) for op in through_gloo)
    torch.testing.assert_close(gloo, mpi, rtol=1e-10, atol=1e-10)  # the same operands; fp order may differ


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_bad_options_are_named():
    model = Net()
    with pytest.raises(
        mpisolve.OptionError, match="option 'mode' of solver 'adasum' must be one of 'delta', 'gradient'"
    ):
        mpisolve.make_solver("adasum", model, make_adam(model), mode="grad")
    with pytest.raises(mpisolve.OptionError, match="bucket_mb must be > 0"):
        mpisolve.make_solver("adasum", model, make_adam(model), bucket_mb=0)
