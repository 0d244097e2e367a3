"""Local SGD: local steps, and every tau-th step the mean of the ranks' models."""

import pytest
import torch
from torch import nn

import mpisolve


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("explicit_batch", [False, True])
def test_every_tau_steps_the_models_are_averaged(explicit_batch):
    comm = mpisolve.init()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    shadow = nn.Linear(4, 2)  # the same local steps, never averaged
    solver = mpisolve.make_solver(
        "local-sgd", model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm, tau=3
    )
    shadow.load_state_dict(model.state_dict())
    shadow_opt = torch.optim.SGD(shadow.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(comm.rank)
    for step in range(1, 4):
        x, y = torch.randn(5, 4, generator=g), torch.randint(0, 2, (5,), generator=g)
        solver.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        info = solver.step(5 if explicit_batch else None)
        assert info.local_samples == 5  # this step's, whether counted by forward or given
        shadow_opt.zero_grad()
        nn.functional.cross_entropy(shadow(x), y).backward()
        shadow_opt.step()
        assert info.applied == (step == 3) and info.global_samples == (
            15 * comm.size if step == 3 else 0
        )  # all since the last average

    def flat(m: nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    local = torch.tensor(comm.allgather_object(flat(shadow).tolist()))
    torch.testing.assert_close(flat(model), local.mean(0), rtol=1e-6, atol=1e-7)
    solver.close()
