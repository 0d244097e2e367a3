"""A step waits on the device at most once: every solver, one rank and several, staged or not.

On a GPU, reading a tensor's value (``.item()``, ``.tolist()``, ``bool(t)``, ``float(t)``,
``.cpu()``) makes the host wait for everything queued before it. A solver's step reads what
the host needs through :mod:`mpisolve.comm.readback`, which counts the reads; any other read
inside a step is caught here by a torch function mode, on the CPU, where the same code runs.
"""

from __future__ import annotations

import collections
import traceback
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import mpisolve
from mpisolve.comm.communicator import Communicator
from mpisolve.comm.readback import host_reads, reading

#: Tensor methods that read values back to the host (on a GPU: a wait for the device).
READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu"}

#: K-FAC with a factor step every other step and an inversion every fourth.
OPTIONS: dict[str, dict[str, Any]] = {"kfac": {"factor_update_steps": 2, "inv_update_steps": 4}}


class StrayReads(TorchFunctionMode):
    """Counts reads of tensor values made outside :mod:`mpisolve.comm.readback`, by where they happen."""

    def __init__(self) -> None:
        super().__init__()
        self.where: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in READS and not reading():
            frame = traceback.extract_stack(limit=2)[0]  # the caller
            self.where[f"{func.__name__} at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"] += 1
        return func(*args, **(kwargs or {}))


def reads_per_step(name: str, comm: Communicator, steps: int = 8) -> list[tuple[int, dict[str, int]]]:
    """(counted reads, stray reads by place) of each of ``steps`` steps of ``name`` on a small MLP."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    solver = mpisolve.make_solver(name, model, optimizer, comm, **OPTIONS.get(name, {}))
    generator = torch.Generator().manual_seed(comm.rank)
    found = []
    for _ in range(steps):
        x, y = torch.randn(4, 6, generator=generator), torch.randint(0, 3, (4,), generator=generator)
        solver.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        probe, before = StrayReads(), host_reads()
        with probe:
            solver.step()
        found.append((host_reads() - before, dict(probe.where)))
    solver.close()
    return found


def is_kfac_inversion(name: str, step: int) -> bool:
    return name == "kfac" and step % OPTIONS["kfac"]["inv_update_steps"] == 0


def check(name: str, comm: Communicator) -> None:
    for step, (counted, stray) in enumerate(reads_per_step(name, comm)):
        if is_kfac_inversion(name, step):
            continue  # K-FAC's decompositions read their statuses per batch (docs/guide/gpus.md)
        assert not stray, f"{name}, step {step}: reads outside mpisolve.comm.readback: {stray}"
        assert counted <= 1, f"{name}, step {step}: {counted} reads of device values, at most 1 expected"


@pytest.mark.parametrize("name", mpisolve.solver_names())
def test_a_step_reads_device_values_at_most_once_at_one_rank(name):
    check(name, Communicator())


@pytest.mark.parametrize("name", mpisolve.solver_names())
def test_a_step_reads_device_values_at_most_once_on_the_staged_path_at_one_rank(name):
    check(name, Communicator(stage_all=True))


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("stage_all", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("name", mpisolve.solver_names())
def test_a_step_reads_device_values_at_most_once(name, stage_all):
    check(name, Communicator(stage_all=stage_all))


def test_the_probe_sees_a_read_outside_readback():
    t = torch.ones(2)
    probe = StrayReads()
    with probe:
        t.sum().item()
    assert list(probe.where) and all(place.startswith("item at test_host_reads.py") for place in probe.where)
