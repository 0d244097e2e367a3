"""A small ResNet trained on an image folder with mpisolve.

Run: mpiexec -n 2 python -m mpi4py examples/resnet_image_folder.py ROOT [--epochs 2]

ROOT holds one directory per class of image files (PNG, JPEG: what Pillow reads), as
torchvision's ImageFolder expects. The model has BatchNorm layers: the synchronous solvers
keep rank 0's running statistics on every rank (``broadcast_buffers=True``, as DDP), so
every rank evaluates the same model. The loop runs inside ``solver.join()``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import mpisolve


class ImageFolder(Dataset):
    """root/<class>/<image>: RGB tensors of size x size in [0, 1], and the class index."""

    def __init__(self, root: str, size: int) -> None:
        self.size = size
        self.classes = sorted(p.name for p in Path(root).iterdir() if p.is_dir())
        self.items = [
            (path, label)
            for label, name in enumerate(self.classes)
            for path in sorted((Path(root) / name).iterdir())
            if path.is_file()
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.items[i]
        image = Image.open(path).convert("RGB").resize((self.size, self.size))
        return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1), label


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.skip = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def resnet(classes: int, width: int = 16) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, 1, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        Block(width, width, 1),
        Block(width, 2 * width, 2),
        Block(2 * width, 4 * width, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, classes),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("root")
    parser.add_argument("--solver", default="allreduce", choices=mpisolve.solver_names())
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--size", type=int, default=32, help="images are resized to this many pixels square")
    parser.add_argument("--width", type=int, default=16, help="channels of the first block")
    args = parser.parse_args()

    comm = mpisolve.init()
    data = ImageFolder(args.root, args.size)
    torch.manual_seed(0)
    model = resnet(len(data.classes), args.width).to(comm.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = DistributedSampler(data, num_replicas=comm.size, rank=comm.rank, shuffle=True, seed=0)
    with mpisolve.make_solver(args.solver, model, optimizer) as solver:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            losses = []
            with solver.join():
                for x, y in DataLoader(data, batch_size=args.batch_size, sampler=sampler):
                    solver.zero_grad()
                    loss = nn.functional.cross_entropy(model(x.to(comm.device)), y.to(comm.device))
                    loss.backward()
                    solver.step()
                    losses.append(loss.item())
            with solver.evaluating() as m, torch.no_grad():
                m.eval()
                correct = sum(int((m(x.to(comm.device)).argmax(1).cpu() == y).sum()) for x, y in DataLoader(data, 64))
                m.train()
            statistics = torch.cat([b.double().reshape(-1) for b in model.buffers()]).sum().item()
            line = (
                f"rank {comm.rank} epoch {epoch} accuracy {correct / len(data):.3f} bn {statistics:.6f} "
                f"train loss {sum(losses) / len(losses):.4f}"
            )
            # Every rank's line, printed by rank 0 (ranks printing at once interleave their output):
            # the same accuracy and statistics on each shows one model everywhere.
            lines = comm.allgather_object(line)
            if comm.rank == 0:
                print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
