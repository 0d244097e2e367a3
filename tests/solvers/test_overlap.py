"""Windowed solvers whose parameters meet the window through a host twin exchange on a thread.

The exchange started at step k overlaps step k + 1's forward and backward, and its change
reaches the parameters in step k + 1's ``step()``, before the optimizer's: checked against a plain torch
re-implementation of that schedule (one rank, staging forced so that the twin, the window
and the thread are all used), and at two ranks, where every rank must end with the center.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mpisolve
from mpisolve.comm.communicator import Communicator

ALPHA, LR, STEPS = 0.3, 0.1, 6


def batches(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(5, 3, generator=generator) for _ in range(STEPS)]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x).square().mean()


def oracle() -> torch.Tensor:
    """EASGD at one rank with each exchange's change applied one step late, in plain torch."""
    m = model()
    x = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    center, change = x.clone(), None
    for batch in batches(0):
        torch.nn.utils.vector_to_parameters(x, m.parameters())
        m.zero_grad()
        loss(m, batch).backward()  # overlaps the last exchange: at the parameters without its change
        if change is not None:  # the last exchange's change lands in this step
            x += change
        x -= LR * torch.cat([p.grad.reshape(-1) for p in m.parameters()])
        pull = ALPHA * (x - center)  # the exchange, on a snapshot of x
        center += pull
        change = -pull
    return center  # close() leaves the center in the model


def train(comm: Communicator, name: str, **options: object) -> tuple[nn.Module, mpisolve.solvers.Solver]:
    m = model()
    solver = mpisolve.make_solver(name, m, torch.optim.SGD(m.parameters(), lr=LR), comm, tau=1, **options)
    for batch in batches(comm.rank):
        solver.zero_grad()
        loss(m, batch).backward()
        solver.step()
    return m, solver


@pytest.mark.parametrize("name", ["ea-wild", "async-easgd"])
def test_an_overlapped_exchange_lands_one_step_later(name):
    m, solver = train(Communicator(stage_all=True), name, alpha=ALPHA)
    assert solver._overlapped is not None
    solver.close()
    got = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    torch.testing.assert_close(got, oracle())
    # In the step, the exchange lands at once: another model.
    m, solver = train(Communicator(stage_all=True), name, alpha=ALPHA, overlap=False)
    assert solver._overlapped is None
    solver.close()
    assert not torch.allclose(torch.cat([p.detach().reshape(-1) for p in m.parameters()]), oracle())


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("name", ["ea-wild", "async-sgd", "async-measgd"])
def test_overlapped_exchanges_end_with_the_center_on_every_rank(name):
    comm = Communicator(stage_all=True)
    options = {"momentum": 0.5} if name == "async-measgd" else {}
    m, solver = train(comm, name, **options)
    assert solver._overlapped is not None
    solver.close()
    final = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    assert torch.isfinite(final).all()
    everyone = comm.allgather_object(final)
    for other in everyone:
        assert torch.equal(other, everyone[0])
