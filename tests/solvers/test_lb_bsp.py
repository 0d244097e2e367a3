"""LB-BSP: speed-proportional micro-batches, and an update equal to one process on the global batch."""

import pytest
import torch
from torch import nn

import mpisolve


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4)
def test_weighted_update_matches_one_process_on_the_global_batch():
    comm = mpisolve.init()
    torch.manual_seed(comm.rank)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    speeds = ",".join(str(r + 1) for r in range(comm.size))
    solver = mpisolve.make_solver(
        "lb-bsp", model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm, speeds=speeds
    )
    reference = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    reference.load_state_dict(model.state_dict())  # rank 0's, broadcast by the solver
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    mine = solver.local_batch_size(4)
    sizes = solver.batch_sizes
    assert sum(sizes) == 4 * comm.size and sizes == sorted(sizes) and mine == sizes[comm.rank]
    lo = sum(sizes[: comm.rank])
    g = torch.Generator().manual_seed(11)
    for _ in range(3):
        x, y = torch.randn(4 * comm.size, 5, generator=g), torch.randint(0, 3, (4 * comm.size,), generator=g)
        solver.zero_grad()
        nn.functional.cross_entropy(model(x[lo : lo + mine]), y[lo : lo + mine]).backward()
        info = solver.step()
        assert info.applied and info.local_samples == mine and info.global_samples == 4 * comm.size
        ref_opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    solver.close()


@pytest.mark.mpi(min_size=2)
def test_measured_speeds_give_slow_ranks_smaller_batches():
    comm = mpisolve.init()
    model = nn.Linear(3, 2)
    solver = mpisolve.make_solver("lb-bsp", model, torch.optim.SGD(model.parameters(), lr=0.1), comm, measure_batches=2)
    calls = []

    def probe(n):  # rank r takes r + 1 ms per sample
        calls.append(n)
        return n * (comm.rank + 1) * 1e-3

    mine = solver.local_batch_size(30, probe)
    assert calls == [30, 30, 30]  # a warm-up, then the measured ones
    assert sum(solver.batch_sizes) == 30 * comm.size and solver.batch_sizes == sorted(solver.batch_sizes, reverse=True)
    assert solver.local_batch_size(30, probe) == mine and len(calls) == 3  # decided once
    with pytest.raises(mpisolve.OptionError, match="3 speeds for"):
        mpisolve.make_solver("lb-bsp", model, torch.optim.SGD(model.parameters(), lr=0.1), comm, speeds="1,2,3")
    solver.close()
