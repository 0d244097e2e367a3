"""What the model needs to know about a network: parameters, tensors, its layers in order.

The ImageNet models (1000 classes) are described layer by layer here, without torch:
ResNet-18, -50, -101 and -152 (224x224 inputs; v1.5, the stride in the 3x3 convolution;
batch norm after every convolution), VGG-16 (224x224, convolutions and classifier with
biases, no batch norm) and Inception V3 (299x299, without the auxiliary classifier;
batch norm after every convolution). Their parameter counts are torchvision's (Keras'
published ones differ by its convolution biases and batch-norm form: 138.4 M, 44.7 M,
60.4 M and 23.9 M for VGG-16, ResNet-101, ResNet-152 and Inception V3). ``mlp``, ``cnn``
and ``cifar-resnet18`` are mpisolve's built-in models (:mod:`mpisolve.train.models`) on
the digits data (1x8x8) or CIFAR (3x32x32), read from the torch modules themselves.

A layer's forward work is ``2 a_dim g_dim positions`` flops a sample; the timeline of
backward (:mod:`.iteration`) gives each layer a share of backward in that proportion.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InputError

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class Layer:
    """A Linear or Conv2d layer as K-FAC sees it: factor A is a_dim x a_dim, G g_dim x g_dim;
    ``positions`` output positions per sample (1 for Linear)."""

    a_dim: int
    g_dim: int
    positions: int

    @property
    def flops(self) -> float:
        """Forward flops a sample."""
        return 2.0 * self.a_dim * self.g_dim * self.positions


@dataclass(frozen=True)
class Workload:
    name: str
    params: int  # every trainable element
    tensors: int  # trainable tensors (Adasum computes statistics per tensor)
    layers: tuple[Layer, ...]  # the Linear and Conv2d layers

    @property
    def forward_flops_per_sample(self) -> float:
        return sum(layer.flops for layer in self.layers)


class _Builder:
    """Layers and parameter counts of an ImageNet model, convolution by convolution."""

    def __init__(self) -> None:
        self.layers: list[Layer] = []
        self.params = 0
        self.tensors = 0

    def conv(self, c_in: int, c_out: int, kernel: tuple[int, int], side: int, *, norm: bool = True) -> None:
        """A convolution of ``side`` x ``side`` outputs: batch norm after it (``norm``), else a bias."""
        weights = c_in * kernel[0] * kernel[1]
        self.layers.append(Layer(weights if norm else weights + 1, c_out, side * side))
        self.params += weights * c_out + (2 if norm else 1) * c_out
        self.tensors += 3 if norm else 2

    def linear(self, c_in: int, c_out: int) -> None:
        self.layers.append(Layer(c_in + 1, c_out, 1))
        self.params += (c_in + 1) * c_out
        self.tensors += 2

    def workload(self, name: str) -> Workload:
        return Workload(name, self.params, self.tensors, tuple(self.layers))


def _resnet(blocks: tuple[int, ...], bottleneck: bool, name: str) -> Workload:
    """An ImageNet ResNet: a 7x7 stem, four stages, global pooling, a 1000-way classifier."""
    net = _Builder()
    net.conv(3, 64, (7, 7), 112)
    cin, side = 64, 56
    for stage, count in enumerate(blocks):
        width = 64 << stage
        out = width * 4 if bottleneck else width
        for block in range(count):
            stride = 2 if stage > 0 and block == 0 else 1
            side_out = side // stride
            if bottleneck:
                net.conv(cin, width, (1, 1), side)
                net.conv(width, width, (3, 3), side_out)
                net.conv(width, out, (1, 1), side_out)
            else:
                net.conv(cin, width, (3, 3), side_out)
                net.conv(width, width, (3, 3), side_out)
            if stride != 1 or cin != out:
                net.conv(cin, out, (1, 1), side_out)
            cin, side = out, side_out
    net.linear(cin, 1000)
    return net.workload(name)


def _vgg16() -> Workload:
    """VGG-16 (configuration D): thirteen 3x3 convolutions with biases, three linear layers."""
    net = _Builder()
    cin, side = 3, 224
    for width, count in ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3)):
        for _ in range(count):
            net.conv(cin, width, (3, 3), side, norm=False)
            cin = width
        side //= 2
    net.linear(512 * 7 * 7, 4096)
    net.linear(4096, 4096)
    net.linear(4096, 1000)
    return net.workload("vgg16")


def _inception_v3() -> Workload:
    """Inception V3 at 299x299 (torchvision's layout), without the auxiliary classifier."""
    net = _Builder()
    for c_in, c_out, k, side in (
        (3, 32, 3, 149),
        (32, 32, 3, 147),
        (32, 64, 3, 147),
        (64, 80, 1, 73),
        (80, 192, 3, 71),
    ):
        net.conv(c_in, c_out, (k, k), side)
    cin = 192
    for pool in (32, 64, 64):  # Mixed_5b-d at 35x35
        net.conv(cin, 64, (1, 1), 35)
        net.conv(cin, 48, (1, 1), 35)
        net.conv(48, 64, (5, 5), 35)
        net.conv(cin, 64, (1, 1), 35)
        net.conv(64, 96, (3, 3), 35)
        net.conv(96, 96, (3, 3), 35)
        net.conv(cin, pool, (1, 1), 35)
        cin = 64 + 64 + 96 + pool
    net.conv(cin, 384, (3, 3), 17)  # Mixed_6a: 35 -> 17
    net.conv(cin, 64, (1, 1), 35)
    net.conv(64, 96, (3, 3), 35)
    net.conv(96, 96, (3, 3), 17)
    cin += 384 + 96
    for c7 in (128, 160, 160, 192):  # Mixed_6b-e at 17x17
        net.conv(cin, 192, (1, 1), 17)
        net.conv(cin, c7, (1, 1), 17)
        net.conv(c7, c7, (1, 7), 17)
        net.conv(c7, 192, (7, 1), 17)
        net.conv(cin, c7, (1, 1), 17)
        for kernel in ((7, 1), (1, 7), (7, 1)):
            net.conv(c7, c7, kernel, 17)
        net.conv(c7, 192, (1, 7), 17)
        net.conv(cin, 192, (1, 1), 17)
    net.conv(cin, 192, (1, 1), 17)  # Mixed_7a: 17 -> 8
    net.conv(192, 320, (3, 3), 8)
    net.conv(cin, 192, (1, 1), 17)
    net.conv(192, 192, (1, 7), 17)
    net.conv(192, 192, (7, 1), 17)
    net.conv(192, 192, (3, 3), 8)
    cin += 320 + 192
    for _ in range(2):  # Mixed_7b-c at 8x8
        net.conv(cin, 320, (1, 1), 8)
        net.conv(cin, 384, (1, 1), 8)
        net.conv(384, 384, (1, 3), 8)
        net.conv(384, 384, (3, 1), 8)
        net.conv(cin, 448, (1, 1), 8)
        net.conv(448, 384, (3, 3), 8)
        net.conv(384, 384, (1, 3), 8)
        net.conv(384, 384, (3, 1), 8)
        net.conv(cin, 192, (1, 1), 8)
        cin = 320 + 768 + 768 + 192
    net.linear(cin, 1000)
    return net.workload("inception-v3")


def of_module(module: nn.Module, example: torch.Tensor, name: str) -> Workload:
    """The workload of a torch module: its trainable parameters, and its Linear and Conv2d
    layers in the order one forward pass on ``example`` (a batch) runs them."""
    import torch
    from torch import nn

    found: list[Layer] = []

    def record(layer: nn.Module, _inputs: object, output: torch.Tensor) -> None:
        bias = 1 if getattr(layer, "bias", None) is not None else 0
        if isinstance(layer, nn.Conv2d):
            kh, kw = layer.kernel_size
            found.append(
                Layer(layer.in_channels * kh * kw + bias, layer.out_channels, output.shape[2] * output.shape[3])
            )
        elif isinstance(layer, nn.Linear):
            found.append(Layer(layer.in_features + bias, layer.out_features, 1))

    hooks = [m.register_forward_hook(record) for m in module.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    try:
        with torch.no_grad():
            module(example)
    finally:
        for hook in hooks:
            hook.remove()
    trainable = [p for p in module.parameters() if p.requires_grad]
    return Workload(name, sum(p.numel() for p in trainable), len(trainable), tuple(found))


def _builtin(model: str, in_shape: tuple[int, ...], classes: int, name: str) -> Workload:
    """One of mpisolve's own models (imports torch)."""
    import torch

    from ..train.models import build_model

    return of_module(build_model(model, in_shape, classes), torch.zeros(1, *in_shape), name)


#: The ImageNet models, built without torch.
IMAGENET: dict[str, Callable[[], Workload]] = {
    "resnet18": lambda: _resnet((2, 2, 2, 2), False, "resnet18"),
    "resnet50": lambda: _resnet((3, 4, 6, 3), True, "resnet50"),
    "resnet101": lambda: _resnet((3, 4, 23, 3), True, "resnet101"),
    "resnet152": lambda: _resnet((3, 8, 36, 3), True, "resnet152"),
    "vgg16": _vgg16,
    "inception-v3": _inception_v3,
}
WORKLOADS = (*IMAGENET, "mlp", "cnn", "cifar-resnet18")


def workload(name: str) -> Workload:
    """The workload called ``name`` (one of :data:`WORKLOADS`)."""
    if name in IMAGENET:
        return IMAGENET[name]()
    if name in ("mlp", "cnn"):
        return _builtin(name, (1, 8, 8), 10, name)
    if name == "cifar-resnet18":
        return _builtin("resnet18", (3, 32, 32), 10, name)
    raise InputError(f"unknown model {name!r} (known: {', '.join(WORKLOADS)})")
