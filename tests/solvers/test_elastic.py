"""The EASGD family and EA-wild: the update equations, convergence on digits, both window paths, shutdown."""

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn

import mpisolve
from mpisolve.comm.communicator import Communicator
from mpisolve.train.config import TrainConfig
from mpisolve.train.loop import train

ASYNC = ["async-sgd", "async-msgd", "hogwild-sgd", "async-easgd", "async-measgd", "ea-wild"]
#: learning rate and options per solver for the digits runs (the m variants carry momentum 0.9)
SETTINGS = {
    "easgd": (0.1, {}),
    "async-sgd": (0.1, {}),
    "async-msgd": (0.02, {"momentum": 0.9}),
    "hogwild-sgd": (0.1, {}),
    "async-easgd": (0.1, {}),
    "async-measgd": (0.02, {"momentum": 0.9}),
    "ea-wild": (0.1, {}),
}


def digits():
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    x = torch.tensor(x[order] / 16.0, dtype=torch.float32)
    y = torch.tensor(y[order])
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def gathered_equal(comm, tensor):
    values = comm.allgather_object(tensor.tolist())
    return all(v == values[0] for v in values)


def train_digits(comm, name, steps, extra_steps=0, **options):
    """Train on this rank's shard; return the test accuracy of the model after close (the center)."""
    (x, y), (x_test, y_test) = digits()
    x, y = x[comm.rank :: comm.size], y[comm.rank :: comm.size]
    lr, settings = SETTINGS[name]
    model = mlp()
    solver = mpisolve.make_solver(
        name, model, torch.optim.SGD(model.parameters(), lr=lr), comm.comm, **settings, **options
    )
    gen = torch.Generator().manual_seed(comm.rank)
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(steps + extra_steps):
        idx = torch.randint(0, len(y), (32,), generator=gen)
        solver.zero_grad()
        loss_fn(model(x[idx]), y[idx]).backward()
        info = solver.step()
        assert info.applied and info.local_samples == 32
    solver.close()
    if hasattr(solver, "vector"):
        assert solver.vector.closed and not solver.vector.win, "close() must free the window"
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert gathered_equal(comm, flat), "after close every rank must hold the same center"
    with torch.no_grad():
        return (model(x_test).argmax(1) == y_test).float().mean().item()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["easgd", *ASYNC])
def test_converges_on_digits(name):
    comm = Communicator()
    accuracy = train_digits(comm, name, steps=200)
    print(f"{name} at {comm.size} ranks: test accuracy {accuracy:.3f}")
    assert accuracy > 0.8, f"{name}: test accuracy {accuracy:.3f} (chance is 0.1)"


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4)
@pytest.mark.parametrize("tau", [1, 3])
def test_synchronous_easgd_follows_the_update_equations(tau):
    """Each rank replays every worker's SGD and elastic updates in float64 and compares."""
    comm = Communicator()
    p, alpha, lr, steps = comm.size, 0.2, 0.1, 7

    def batch(rank, step):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        return torch.randn(5, 3, generator=gen, dtype=torch.float64), torch.randn(
            5, 2, generator=gen, dtype=torch.float64
        )

    def grad(w, b, x, t):
        w = w.clone().requires_grad_(True)
        b = b.clone().requires_grad_(True)
        ((x @ w.T + b - t) ** 2).mean().backward()
        return w.grad, b.grad

    torch.manual_seed(3)
    model = nn.Linear(3, 2).double()
    solver = mpisolve.make_solver(
        "easgd", model, torch.optim.SGD(model.parameters(), lr=lr), comm.comm, tau=tau, alpha=alpha
    )
    workers = [(model.weight.detach().clone(), model.bias.detach().clone()) for _ in range(p)]
    center = [t.clone() for t in workers[0]]
    for step in range(steps):
        x, t = batch(comm.rank, step)
        solver.zero_grad()
        ((model(x) - t) ** 2).mean().backward()
        solver.step()
        grads = [grad(*wb, *batch(r, step)) for r, wb in enumerate(workers)]
        workers = [(w - lr * gw, b - lr * gb) for (w, b), (gw, gb) in zip(workers, grads)]
        if (step + 1) % tau == 0:
            new_center = [c + alpha * sum(wk[i] - c for wk in workers) for i, c in enumerate(center)]
            workers = [tuple(wk[i] - alpha * (wk[i] - center[i]) for i in range(2)) for wk in workers]
            center = new_center
        torch.testing.assert_close(model.weight.detach(), workers[comm.rank][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(model.bias.detach(), workers[comm.rank][1], rtol=1e-12, atol=1e-12)
    with solver.evaluating():
        torch.testing.assert_close(model.weight.detach(), center[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model.weight.detach(), workers[comm.rank][0])  # restored after evaluating
    solver.close()
    torch.testing.assert_close(model.weight.detach(), center[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model.bias.detach(), center[1], rtol=1e-12, atol=1e-12)


def turn_by_turn(comm, name, force_internode, rounds=4):
    """Ranks step one at a time (a barrier between turns), so an asynchronous run is deterministic."""
    torch.manual_seed(5)
    model = nn.Linear(6, 3)
    solver = mpisolve.make_solver(
        name, model, torch.optim.SGD(model.parameters(), lr=0.1), comm.comm, tau=1, force_internode=force_internode
    )
    assert solver.vector.path == ("internode" if force_internode else "shared")
    gen = torch.Generator().manual_seed(comm.rank)
    for _ in range(rounds):
        for turn in range(comm.size):
            if turn == comm.rank:
                x = torch.randn(4, 6, generator=gen)
                solver.zero_grad()
                model(x).square().mean().backward()
                solver.step()
            comm.barrier()
    solver.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["async-easgd", "ea-wild", "async-sgd", "hogwild-sgd"])
def test_forced_internode_path_has_the_shared_memory_semantics(name):
    comm = Communicator()
    shared = turn_by_turn(comm, name, force_internode=False)
    internode = turn_by_turn(comm, name, force_internode=True)
    torch.testing.assert_close(internode, shared, rtol=1e-6, atol=1e-7)
    torch.manual_seed(5)
    assert not torch.allclose(shared, torch.cat([p.reshape(-1) for p in nn.Linear(6, 3).parameters()]).detach())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("force_internode", [False, True])
@pytest.mark.parametrize("name", ["ea-wild", "async-easgd"])
def test_close_while_other_ranks_are_still_sending(name, force_internode):
    """Rank 0 stops after 3 steps and closes while the others go on exchanging; nobody hangs."""
    comm = Communicator()
    train_digits(comm, name, steps=3, extra_steps=0 if comm.rank == 0 else 60, tau=1, force_internode=force_internode)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)
def test_state_dict_round_trip_and_evaluating_show_the_center():
    comm = Communicator()
    torch.manual_seed(1)
    model = nn.Linear(4, 2)
    solver = mpisolve.make_solver("async-measgd", model, torch.optim.SGD(model.parameters(), lr=0.05), comm.comm, tau=2)
    for _ in range(3 + comm.rank):
        solver.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        solver.step()
    comm.barrier()
    state = solver.state_dict()
    assert state["steps"] == 3 + comm.rank and state["velocity"].abs().sum() > 0
    own = solver.flat.clone()
    with solver.evaluating():
        torch.testing.assert_close(solver.flat, state["center"])
    torch.testing.assert_close(solver.flat, own)
    center = state["center"] + 1.0
    solver.load_state_dict({**state, "center": center})
    after = solver.state_dict()
    torch.testing.assert_close(after["center"], center)
    solver.close()
    torch.testing.assert_close(solver.flat, center)


@pytest.mark.mpi(min_size=2)
def test_easgd_refuses_a_center_step_above_one_on_every_rank():
    comm = Communicator()
    model = nn.Linear(2, 2)
    with pytest.raises(mpisolve.OptionError, match="alpha \\* ranks <= 1"):
        mpisolve.make_solver("easgd", model, torch.optim.SGD(model.parameters(), lr=0.1), comm.comm, alpha=0.6)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 4)
def test_easgd_under_the_trainer_evaluates_and_stops_with_every_rank():
    """easgd is lockstep: every rank evaluates and stops at the same exchange, the round's
    samples counted over all ranks. (Counted as the asynchronous solvers are, a rank would
    evaluate while another waited in an exchange, and the run would hang.)"""
    comm = mpisolve.init()
    slowdown = tuple(2.0 if r == comm.size - 1 else 1.0 for r in range(comm.size))
    config = TrainConfig(
        solver="easgd",
        model="mlp",
        dataset="digits",
        batch_size=16,
        epochs=0.5,
        eval_every=0.1,
        log_every=2,
        hetero=slowdown,
        options={"tau": 3},
    )
    summary = train(config, comm, show=False)
    samples_per_round = 3 * 16 * comm.size
    assert summary["steps"] % 3 == 0 and summary["final_accuracy"] is not None
    assert summary["epochs"] * 1438 == pytest.approx(summary["steps"] // 3 * samples_per_round)
    assert len(set(comm.allgather_object(summary["steps"]))) == 1


class WrittenAfterEachRead(torch.Tensor):
    """Shared memory into which another rank writes right after every read of it (a wild window)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        result = super().__torch_function__(func, types, args, kwargs or {})
        if func is torch.Tensor.copy_ and isinstance(args[1], cls):
            with torch._C.DisableTorchFunctionSubclass():
                args[1].add_(1.0)
        return result


def test_hogwild_takes_its_anchor_from_the_same_read_as_its_parameters():
    # Read twice, the anchor held another rank's write that x did not: the next push,
    # x - anchor, would then have taken that write back out of the shared parameters.
    torch.manual_seed(2)
    model = nn.Linear(3, 2)
    solver = mpisolve.make_solver("hogwild-sgd", model, torch.optim.SGD(model.parameters(), lr=0.1))
    n = solver.flat.numel()
    shared = torch.randn(n).as_subclass(WrittenAfterEachRead)
    pulled = shared.as_subclass(torch.Tensor).clone() + (solver.local - solver.anchor)
    solver.exchange_function(shared, 0, n)
    assert torch.equal(solver.local, pulled)
    assert torch.equal(solver.anchor, solver.local)
    solver.close()
