"""The README's loop runs as printed, and gives the model one process gets on the same global batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from tests.doc_blocks import python_block

README = Path(__file__).resolve().parents[1] / "README.md"
SAMPLES, FEATURES, CLASSES = 160, 8, 3


def readme_loop() -> str:
    """The Python block that follows the ``readme-loop`` marker in README.md."""
    return python_block(README, "readme-loop")


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES))


def data_set(seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    return TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long())


def accuracy(model: torch.nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def one_process_oracle(train_set: TensorDataset, ranks: int, batch: int, epochs: int) -> torch.nn.Module:
    """SGD in one process, each step on every rank's batch together (the allreduce solver's contract)."""
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    samplers = [DistributedSampler(train_set, num_replicas=ranks, rank=r) for r in range(ranks)]
    for epoch in range(epochs):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        orders = [list(sampler) for sampler in samplers]
        for start in range(0, len(orders[0]), batch):
            index = [i for order in orders for i in order[start : start + batch]]
            x, y = train_set.tensors[0][index], train_set.tensors[1][index]
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return model


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_readme_loop_runs_and_matches_one_process():
    import mpisolve

    comm = mpisolve.init()
    printed: list[tuple] = []
    namespace = {
        "build_model": build_model,
        "train_set": data_set(1),
        "test_set": data_set(2),
        "accuracy": accuracy,
        "print": lambda *args: printed.append(args),
    }
    exec(compile(readme_loop(), str(README), "exec"), namespace)

    assert [epoch for epoch, _ in printed] == [0, 1, 2], "the loop evaluates once per epoch"
    assert namespace["solver"].closed
    expected = one_process_oracle(namespace["train_set"], comm.size, batch=32, epochs=3)
    for got, want in zip(namespace["model"].parameters(), expected.parameters()):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
