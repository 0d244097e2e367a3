"""What the model needs to know about a network: parameters, tensors, K-FAC layers.

ResNet-18 and ResNet-50 (ImageNet form, 224x224 inputs, 1000 classes; ResNet-50 v1.5
with the stride in the 3x3 convolution) are described layer by layer here, without
torch. ``mlp``, ``cnn`` and ``cifar-resnet18`` are mpisolve's built-in models
(:mod:`mpisolve.train.models`) on the digits data (1x8x8) or CIFAR (3x32x32), read from
the torch modules themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError


@dataclass(frozen=True)
class Layer:
    """A Linear or Conv2d layer as K-FAC sees it: factor A is a_dim x a_dim, G g_dim x g_dim;
    ``positions`` output positions per sample (1 for Linear)."""

    a_dim: int
    g_dim: int
    positions: int


@dataclass(frozen=True)
class Workload:
    name: str
    params: int  # every trainable element
    tensors: int  # trainable tensors (Adasum computes statistics per tensor)
    layers: tuple[Layer, ...]  # the Linear and Conv2d layers

    @property
    def forward_flops_per_sample(self) -> float:
        return float(sum(2 * (layer.a_dim * layer.g_dim) * layer.positions for layer in self.layers))


def _resnet(blocks: tuple[int, ...], bottleneck: bool) -> Workload:
    """An ImageNet ResNet: a 7x7 stem, four stages, global pooling, a 1000-way classifier."""
    layers = [Layer(3 * 7 * 7, 64, 112 * 112)]
    params, tensors = 3 * 7 * 7 * 64 + 2 * 64, 3  # stem conv and its batch norm
    cin, side = 64, 56

    def conv(c_in: int, c_out: int, kernel: int, positions: int) -> None:
        nonlocal params, tensors
        layers.append(Layer(c_in * kernel * kernel, c_out, positions))
        params += c_in * kernel * kernel * c_out + 2 * c_out  # weight, batch norm's scale and shift
        tensors += 3

    for stage, count in enumerate(blocks):
        width = 64 << stage
        out = width * 4 if bottleneck else width
        for block in range(count):
            stride = 2 if stage > 0 and block == 0 else 1
            side_out = side // stride
            if bottleneck:
                conv(cin, width, 1, side * side)
                conv(width, width, 3, side_out * side_out)
                conv(width, out, 1, side_out * side_out)
            else:
                conv(cin, width, 3, side_out * side_out)
                conv(width, width, 3, side_out * side_out)
            if stride != 1 or cin != out:
                conv(cin, out, 1, side_out * side_out)
            cin, side = out, side_out
    layers.append(Layer(cin + 1, 1000, 1))
    params += cin * 1000 + 1000
    tensors += 2
    return Workload("resnet50" if bottleneck else "resnet18", params, tensors, tuple(layers))


def _builtin(model: str, in_shape: tuple[int, ...], classes: int, name: str) -> Workload:
    """One of mpisolve's own models, measured on its torch module (imports torch)."""
    import torch
    from torch import nn

    from ..train.models import build_model

    module = build_model(model, in_shape, classes)
    found: list[Layer] = []

    def record(layer: nn.Linear | nn.Conv2d, _inputs: object, output: torch.Tensor) -> None:
        bias = 1 if layer.bias is not None else 0
        if isinstance(layer, nn.Conv2d):
            kh, kw = layer.kernel_size
            found.append(
                Layer(layer.in_channels * kh * kw + bias, layer.out_channels, output.shape[2] * output.shape[3])
            )
        else:
            found.append(Layer(layer.in_features + bias, layer.out_features, 1))

    hooks = [m.register_forward_hook(record) for m in module.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    with torch.no_grad():
        module(torch.zeros(1, *in_shape))
    for hook in hooks:
        hook.remove()
    trainable = [p for p in module.parameters() if p.requires_grad]
    return Workload(name, sum(p.numel() for p in trainable), len(trainable), tuple(found))


WORKLOADS = ("resnet18", "resnet50", "mlp", "cnn", "cifar-resnet18")


def workload(name: str) -> Workload:
    """The workload called ``name`` (one of :data:`WORKLOADS`)."""
    if name == "resnet18":
        return _resnet((2, 2, 2, 2), bottleneck=False)
    if name == "resnet50":
        return _resnet((3, 4, 6, 3), bottleneck=True)
    if name in ("mlp", "cnn"):
        return _builtin(name, (1, 8, 8), 10, name)
    if name == "cifar-resnet18":
        return _builtin("resnet18", (3, 32, 32), 10, name)
    raise InputError(f"unknown model {name!r} (known: {', '.join(WORKLOADS)})")
