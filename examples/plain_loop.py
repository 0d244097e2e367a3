"""A plain training loop with mpisolve: DistributedSampler, join(), evaluation.

Run: mpiexec -n 2 python -m mpi4py examples/plain_loop.py [--solver allreduce] [--epochs 3]

Every rank builds the same model and data; DistributedSampler gives each rank its share
of every epoch (no torch.distributed needed: it takes the number of replicas and this
rank). The loop is wrapped in solver.join(), so that a rank whose share ends a batch
early (a data set that does not divide by ranks x batch) takes part in the others' last
steps instead of leaving them waiting.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mpisolve


def make_data(n: int, seed: int) -> TensorDataset:
    """Points in 8 dimensions, labelled by which of 4 fixed directions they lie closest to."""
    g = torch.Generator().manual_seed(seed)
    directions = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x @ directions.T).argmax(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--solver", default="allreduce", choices=mpisolve.solver_names())
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()

    comm = mpisolve.init()
    torch.manual_seed(0)  # every rank builds the same model (the solver also broadcasts rank 0's)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).to(comm.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if "msgd" not in args.solver else 0.0)
    options = {"micro_batch": "fixed"} if args.solver == "abs-sgd" else {}
    if args.solver == "lb-bsp":
        options = {"speeds": ",".join(["1"] * comm.size)}
    train_set, test_set = make_data(1000, seed=1), make_data(500, seed=2)

    # DistributedSampler pads the data so that every rank gets as many samples; join() keeps
    # loops over shares that differ (a sampler of your own, batch sizes split by speed) safe.
    sampler = DistributedSampler(train_set, num_replicas=comm.size, rank=comm.rank, shuffle=True, seed=0)
    with mpisolve.make_solver(args.solver, model, optimizer, **options) as solver:
        batch_size = solver.local_batch_size(args.batch_size)
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)  # a new order each epoch, the same on every rank
            loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)
            with solver.join():  # ranks that run out first take part, contributing nothing
                for x, y in loader:
                    solver.zero_grad()
                    loss = nn.functional.cross_entropy(model(x.to(comm.device)), y.to(comm.device))
                    loss.backward()
                    info = solver.step()
                    batch_size = info.next_batch_size or batch_size
            with solver.evaluating() as m, torch.no_grad():
                accuracy = (m(test_set.tensors[0].to(comm.device)).argmax(1).cpu() == test_set.tensors[1]).float()
            if comm.rank == 0:
                print(f"epoch {epoch} test accuracy {accuracy.mean():.3f}", flush=True)


if __name__ == "__main__":
    main()
