"""Every registered solver trains through the staged path exactly as through the direct one.

``Communicator(stage_all=True)`` sends every tensor, CPU ones too, through its own host
buffer on every communicator the solver makes: what a GPU model meets with an MPI that
is not CUDA-aware (copies to and from pinned host twins around each MPI operation, the
elastic solvers' parameters meeting a host window through a twin). Both runs do the same
operations in the same order on the same values, so they must agree bit for bit.

Runs are made deterministic: asynchronous solvers step turn by turn with the window
quiesced between turns, ABS-SGD completes each round before the next step (its
``state_dict``), and options that time the machine (K-FAC's fusion and packing choices,
speed-measured batch sizes) are fixed.
"""

import pytest
import torch
from torch import nn

import mpisolve
from mpisolve.comm.communicator import Communicator
from mpisolve.comm.device import detect_cuda_aware

WINDOWED = ("async-sgd", "async-msgd", "hogwild-sgd", "async-easgd", "async-measgd", "ea-wild")
OPTIONS = {
    "abs-sgd": {"progress": "none", "micro_batch": "fixed"},
    "easgd": {"tau": 2},
    "local-sgd": {"tau": 2},
    "kfac": {
        "variant": "spd-kfac",
        "method": "eigen",
        "fusion": "none",
        "replicate": "never",
        "pack_triangles": True,
        "factor_update_steps": 1,
        "inv_update_steps": 2,
    },
    # In the step, not overlapped: the same exchanges at the same points (tests/solvers/test_overlap.py).
    **{name: {"tau": 1, "overlap": False} for name in WINDOWED},
    "async-msgd": {"tau": 1, "momentum": 0.5, "overlap": False},
    "async-measgd": {"tau": 1, "momentum": 0.5, "overlap": False},
}
STEPS = 4


def train(comm, name, device="cpu", **extra):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(device)
    options = {**OPTIONS.get(name, {}), **extra}
    if name == "lb-bsp":
        options["speeds"] = ",".join(["1"] * comm.size)
    solver = mpisolve.make_solver(name, model, torch.optim.SGD(model.parameters(), lr=0.05), comm, **options)
    windowed = name in WINDOWED
    if windowed:
        staged = comm.stage_all or device != "cpu"
        assert (solver.local is not solver.flat) == (staged and extra.get("window") != "device")
    gen = torch.Generator().manual_seed(10 + comm.rank)
    for _ in range(STEPS):
        for turn in range(comm.size) if windowed else [comm.rank]:
            if turn == comm.rank:
                solver.zero_grad()
                model(torch.randn(4, 6, generator=gen).to(device)).square().mean().backward()
                if device != "cpu":
                    torch.cuda._sleep(20_000_000)  # what step queues runs late: MPI must wait for it
                solver.step()
            if windowed:
                solver.vector.quiesce()
        if name == "abs-sgd":
            solver.state_dict()  # collective: completes the round in flight, so the next step applies it
    solver.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("name", mpisolve.solver_names())
def test_every_solver_trains_staged_as_direct(name):
    direct = train(Communicator(), name)
    staged = train(Communicator(stage_all=True), name)
    assert torch.equal(staged, direct)
    torch.manual_seed(0)
    start = torch.cat(
        [p.detach().reshape(-1) for p in nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).parameters()]
    )
    assert not torch.equal(direct, start), "the run must have changed the model"


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("name", mpisolve.solver_names())
def test_every_solver_trains_through_the_gloo_engine_as_through_mpi(name):
    # The engine code NCCL runs on a GPU, through gloo on CPU tensors: every reusable sum and
    # broadcast (gradient buckets, averages, K-FAC's factors and inverses, tallies) goes there.
    mpi = train(Communicator(), name)
    gloo = train(Communicator(engine="gloo"), name)
    torch.testing.assert_close(gloo, mpi, rtol=1e-4, atol=1e-5)  # sums may add in another order (K-FAC amplifies it)


@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)
@pytest.mark.parametrize("name", mpisolve.solver_names())
def test_every_solver_trains_a_cuda_model_through_gloo_as_a_cpu_one(name):
    # Two ranks sharing a GPU cannot run NCCL: the engine's code on CUDA tensors, through gloo.
    reference = train(Communicator(), name)
    got = train(Communicator(engine="gloo"), name, device="cuda")
    torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("name", WINDOWED)
def test_a_window_in_the_models_memory_equals_the_host_windows_rma_path(name):
    # window="device" on a CPU model: torch allocates the shards and MPI_Win_create exposes
    # them, the inter-node path's one-sided operations on them (a GPU model's with a
    # CUDA-aware MPI); the host window forced onto the inter-node path does the same.
    comm = Communicator()
    internode = train(comm, name, force_internode=True)
    device = train(comm, name, window="device")
    assert torch.equal(device, internode)


@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)
@pytest.mark.parametrize("name", mpisolve.solver_names())
def test_every_solver_trains_a_cuda_model_as_a_cpu_one(name):
    # Staged (any MPI) and, with a CUDA-aware MPI, direct; every step's work queued
    # behind a long kernel, so MPI reading device memory early would see stale values.
    reference = train(Communicator(), name)
    aware = detect_cuda_aware()[0]
    for cuda_aware in [False, True] if aware else [False]:
        got = train(Communicator(cuda_aware=cuda_aware), name, device="cuda")
        torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-5)
    if name in WINDOWED and aware:
        got = train(Communicator(cuda_aware=True), name, device="cuda", window="device")
        torch.testing.assert_close(got, train(Communicator(), name, force_internode=True), rtol=1e-4, atol=1e-5)
