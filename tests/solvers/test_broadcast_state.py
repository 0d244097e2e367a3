"""solver.broadcast_state(root): every rank ends with root's parameters, buffers and optimizer state."""

import pytest
import torch

import mpisolve


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("name", ["allreduce", "adasum"])
def test_root_state_reaches_every_rank(name):
    world = mpisolve.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    solver = mpisolve.make_solver(name, model, optimizer)
    root = world.size - 1
    for _ in range(2):
        solver.zero_grad()
        model(torch.randn(5, 4, generator=torch.Generator().manual_seed(world.rank))).sum().backward()
        solver.step()
    with torch.no_grad():  # each rank's own load: parameters, buffers and optimizer state now differ
        for t in [*model.parameters(), *model.buffers()]:
            t.add_(world.rank)
        for state in optimizer.state.values():
            state["exp_avg"].add_(world.rank)
            state["step"].fill_(10 + world.rank)
    solver.broadcast_state(root)
    mine = [t.clone() for t in [*model.parameters(), *model.buffers()]]
    mine += [s[k].clone() for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq", "step")]
    gathered = mpisolve.allgather([t.reshape(1, -1) for t in mine])
    for g in gathered:
        for r in range(world.size):
            assert torch.equal(g[r], g[root]), "a rank differs from the root after broadcast_state"
    assert optimizer.state[next(iter(optimizer.state))]["step"].item() == 10 + root
    solver.close()
