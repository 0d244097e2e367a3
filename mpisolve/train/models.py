"""The built-in models: the communication-bound MLP, a small CNN, and CIFAR-style ResNet-18."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def mlp(in_shape: tuple[int, ...], classes: int, width: int = 1024, depth: int = 3) -> nn.Module:
    """Many parameters, little compute per sample: the communication-bound case."""
    features = 1
    for d in in_shape:
        features *= d
    layers: list[nn.Module] = [nn.Flatten()]
    for _ in range(depth - 1):
        layers += [nn.Linear(features, width), nn.ReLU()]
        features = width
    layers.append(nn.Linear(features, classes))
    return nn.Sequential(*layers)


def cnn(in_shape: tuple[int, ...], classes: int) -> nn.Module:
    """A small convolutional net (two conv blocks and a classifier)."""
    channels, height, width = in_shape
    return nn.Sequential(
        nn.Conv2d(channels, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * (height // 4) * (width // 4), 128),
        nn.ReLU(),
        nn.Linear(128, classes),
    )


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 in its CIFAR form: 3x3 stem, no max-pool, four stages of two blocks."""

    def __init__(self, in_channels: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        blocks: list[nn.Module] = []
        cin = 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*blocks)
        self.head = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(out, 1), 1))


def resnet18(in_shape: tuple[int, ...], classes: int) -> nn.Module:
    return ResNet18(in_shape[0], classes)


MODELS: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {"mlp": mlp, "cnn": cnn, "resnet18": resnet18}


def build_model(name: str, in_shape: tuple[int, ...], classes: int) -> nn.Module:
    """A built-in model by name, sized for inputs of ``in_shape`` and ``classes`` outputs."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r} (known: {', '.join(MODELS)})")
    return MODELS[name](in_shape, classes)
