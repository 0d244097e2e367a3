"""The models ``--model`` names: built-in, torchvision's, or the user's own.

- ``mlp``, ``cnn``, ``resnet18``: built in: the communication-bound MLP, a small CNN,
  and CIFAR-style ResNet-18.
- ``torchvision:NAME``: ``torchvision.models.get_model(NAME, weights=None,
  num_classes=classes)``, untrained (nothing is downloaded); torchvision is the optional
  extra ``mpisolve[vision]``.
- ``MODULE:FACTORY``: the user's callable (a function or an ``nn.Module`` class),
  called with the keyword arguments it names among ``in_shape`` (one example's shape,
  e.g. ``(3, 32, 32)``) and ``classes`` (the number of classes); it returns the
  ``nn.Module``, whose output on a batch is ``(batch, classes)`` logits.

:func:`model_for` builds one for a data set and checks it on two of its examples, so a
model that does not fit the data fails with one line before training starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import InputError
from .factory import call, describe, is_reference, load_callable

if TYPE_CHECKING:
    from .data import DataSet


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
#: What ``--model`` takes, for help texts and errors.
MODEL_FORMS = f"{', '.join(MODELS)}, torchvision:NAME or MODULE:FACTORY"


def check_model_spec(spec: str) -> None:
    """Raise :class:`InputError` unless ``spec`` has one of the forms of :data:`MODEL_FORMS` (nothing is imported)."""
    kind, sep, name = spec.partition(":")
    if spec in MODELS or (kind == "torchvision" and name) or (kind != "torchvision" and is_reference(spec)):
        return
    raise InputError(f"unknown model {spec!r} (give {MODEL_FORMS})")


def build_model(spec: str, in_shape: tuple[int, ...], classes: int) -> nn.Module:
    """The model ``spec`` names, sized for inputs of ``in_shape`` and ``classes`` outputs."""
    check_model_spec(spec)
    if spec in MODELS:
        return MODELS[spec](in_shape, classes)
    kind, _, name = spec.partition(":")
    model = (
        _torchvision_model(name, classes)
        if kind == "torchvision"
        else call(load_callable(spec, "--model"), spec, "--model", {"in_shape": in_shape, "classes": classes})
    )
    if not isinstance(model, nn.Module):
        raise InputError(f"--model {spec}: the factory returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _torchvision_model(name: str, classes: int) -> nn.Module:
    try:
        from torchvision.models import get_model, list_models
    except ImportError:
        raise InputError(
            f"--model torchvision:{name} needs torchvision: pip install 'mpisolve[vision]' "
            f"(the torchvision release made for torch {torch.__version__})"
        ) from None
    except Exception as err:  # a torchvision built for another torch fails as it registers its operators
        raise InputError(
            f"--model torchvision:{name}: torchvision does not import ({describe(err)}); "
            f"install the torchvision build made for this torch ({torch.__version__})"
        ) from None
    if name not in list_models():
        raise InputError(f"unknown torchvision model {name!r} (torchvision.models.list_models() names them)")
    try:
        model: nn.Module = get_model(name, weights=None, num_classes=classes)
    except Exception as err:
        raise InputError(f"--model torchvision:{name}: {describe(err)}") from None
    return model


def model_for(spec: str, data: DataSet, *, seed: int) -> nn.Module:
    """The model ``spec`` names for ``data``, initialised from ``seed``, checked on two examples.

    The check is one forward pass in eval mode without gradients: it must give
    ``(2, classes)`` logits. It also sizes lazy modules (``nn.LazyLinear``) before any
    solver sees the parameters.
    """
    x, _ = data.train.take(torch.arange(min(2, len(data.train))))
    torch.manual_seed(seed)
    model = build_model(spec, data.in_shape, data.classes)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(x)
    except Exception as err:
        raise InputError(
            f"model {spec} fails on a batch of {data.name} (shape {tuple(x.shape)}, {x.dtype}): {describe(err)}"
        ) from None
    model.train(was_training)
    expected = (len(x), data.classes)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise InputError(
            f"model {spec} gives {got} on a batch of {len(x)} from {data.name}; "
            f"expected logits of shape {expected} ({data.classes} classes)"
        )
    return model
