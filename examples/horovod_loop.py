"""A Horovod training script on mpisolve: the only mpisolve line is the import.

Run: mpiexec -n 2 python -m mpi4py examples/horovod_loop.py [--epochs 3] [--use-adasum] [--fp16-allreduce]

Written the way Horovod's examples/pytorch scripts are (init, a sampler per rank, the
learning rate scaled by the ranks, the state broadcast from rank 0, DistributedOptimizer,
metrics averaged with hvd.allreduce), on a small synthetic data set: a script written
for ``import horovod.torch as hvd`` runs with ``import mpisolve.horovod as hvd`` instead
(docs/guide/from-horovod.md).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mpisolve.horovod as hvd


def make_data(n: int, seed: int) -> TensorDataset:
    """Points in 8 dimensions, labelled by which of 4 fixed directions they lie closest to."""
    g = torch.Generator().manual_seed(seed)
    directions = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x @ directions.T).argmax(dim=1))


def metric_average(value: float, name: str) -> float:
    return float(hvd.allreduce(torch.tensor(value), name=name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--use-adasum", action="store_true")
    parser.add_argument("--fp16-allreduce", action="store_true")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(hvd.rank())  # models differ until the broadcast below
    train_set, test_set = make_data(1000, seed=1), make_data(500, seed=2)
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
    )
    for epoch in range(args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            x, y = test_set.tensors
            shard = slice(hvd.rank(), None, hvd.size())
            accuracy = (model(x[shard]).argmax(dim=1) == y[shard]).float().mean().item()
        accuracy = metric_average(accuracy, "avg_accuracy")
        if hvd.rank() == 0:
            print(f"epoch {epoch} test accuracy {accuracy:.3f}", flush=True)


if __name__ == "__main__":
    main()
