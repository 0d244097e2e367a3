"""Which layers K-FAC preconditions, and their Kronecker factors A and G from one batch.

Scaling convention (KFC, Grosse and Martens 2016). For a layer whose input has batch
size N and S positions per example (S = output height x width for Conv2d, the product of
the middle dimensions of a ``[N, *, in]`` input for Linear, 1 for a plain Linear):

    A = 1/N       sum_{n,s} a_ns a_ns^T     a: the input (the patch, for Conv2d), with a
                                              trailing 1 when the layer has a bias
    G = 1/(N S)   sum_{n,s} g_ns g_ns^T     g = N dL/dy: the per-example gradient of a
                                              loss averaged over the batch

With one example and S = 1, A (x) G is exactly the empirical Fisher block
vec(grad) vec(grad)^T, vec stacking the columns of the ``[out, in(+1)]`` gradient
matrix (weight flattened as ``weight.view(out, -1)``, bias as the last column). With S > 1
it is KFC's approximation of that block. The loss must be averaged over the batch (as
``nn.CrossEntropyLoss`` and ``nn.MSELoss`` do by default); with a summed loss G is N^2
times too large and damping means something else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ...errors import OptionError

#: Most block rows a symmetric product is split into when only its upper triangle is
#: needed: k block rows do (k + 1) / 2k of the full product's work (5/8 at 4), and more
#: blocks mean smaller, less efficient products (docs/studies/kfac-kaisa.md).
UPPER_BLOCKS = 4
#: Fewest rows in a block row: a smaller factor is one full product.
MIN_BLOCK_ROWS = 128


@dataclass
class LayerSpec:
    """A layer K-FAC preconditions: ``a_dim`` = inputs (+1 for the bias), ``g_dim`` = outputs."""

    name: str
    module: nn.Linear | nn.Conv2d
    a_dim: int
    g_dim: int
    has_bias: bool


def _skipped(name: str, module: nn.Module, skip: Sequence[str | type]) -> bool:
    for entry in skip:
        if isinstance(entry, type):
            if isinstance(module, entry):
                return True
        elif name == entry or name.startswith(entry + ".") or type(module).__name__ == entry:
            return True
    return False


def find_layers(model: nn.Module, skip: Sequence[str | type] = ()) -> list[LayerSpec]:
    """The model's Linear and Conv2d layers with a trainable weight, in registration order.

    ``skip`` entries are module names (a name also skips the modules inside it), class
    names, or classes; an entry that matches no module is refused (a misspelt name would
    otherwise go unnoticed). Conv2d with ``groups > 1`` is not Kronecker-factored here and
    keeps its plain gradient, as does every other kind of layer.
    """
    unmatched = [e for e in skip if not any(_skipped(n, m, (e,)) for n, m in model.named_modules())]
    if unmatched:
        names = ", ".join(getattr(e, "__name__", repr(e)) for e in unmatched)
        raise OptionError(f"kfac: skip entries that match no module of the model: {names}")
    layers = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Conv2d)) or _skipped(name, module, skip):
            continue
        if not module.weight.requires_grad:
            continue
        if isinstance(module, nn.Conv2d) and module.groups != 1:
            continue
        has_bias = module.bias is not None and module.bias.requires_grad
        if isinstance(module, nn.Linear):
            a_dim, g_dim = module.in_features, module.out_features
        else:
            a_dim = module.in_channels * module.kernel_size[0] * module.kernel_size[1]
            g_dim = module.out_channels
        layers.append(LayerSpec(name, module, a_dim + int(has_bias), g_dim, has_bias))
    return layers


def conv_patches(module: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """The input patches ``[N, C*kh*kw, S]``, features ordered as ``weight.view(out, -1)``."""
    if isinstance(module.padding, str) or module.padding_mode != "zeros":
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
        padding: tuple[int, ...] | int = 0
    else:
        padding = module.padding
    return F.unfold(x, module.kernel_size, dilation=module.dilation, padding=padding, stride=module.stride)


def gram_(rows: torch.Tensor, out: torch.Tensor, alpha: float, upper_only: bool) -> None:
    """``out <- alpha rows^T rows``; with ``upper_only`` only its upper triangle (diagonal
    included) is sure to be written: the product is made in block rows from the diagonal
    right, which skips most of the work below it (the rest of ``out`` is left unspecified)."""
    n = out.shape[0]
    blocks = min(UPPER_BLOCKS, n // MIN_BLOCK_ROWS) if upper_only else 1
    if blocks <= 1:
        torch.addmm(out, rows.T, rows, beta=0, alpha=alpha, out=out)
        return
    edges = [n * i // blocks for i in range(blocks + 1)]
    for start, end in zip(edges, edges[1:]):
        block = out[start:end, start:]
        torch.addmm(block, rows[:, start:end].T, rows[:, start:], beta=0, alpha=alpha, out=block)


class FactorComputer:
    """Computes one layer's A and G into tensors the caller gives, reusing its row buffers.

    The rows (one per example and position) are laid out in buffers kept between calls
    (reallocated only when the batch shape changes), in the factors' dtype; with a bias
    the trailing 1 is a column of the A rows, so each factor is one matrix product.
    ``upper_only``: the factors' upper triangles are all the caller reads (they travel
    packed), so only they are computed (:func:`gram_`).
    """

    def __init__(self, spec: LayerSpec, *, upper_only: bool = False) -> None:
        self.spec = spec
        self.upper_only = upper_only
        self._buffers: dict[str, torch.Tensor] = {}

    def _rows(self, key: str, count: int, width: int, like: torch.Tensor) -> torch.Tensor:
        rows = self._buffers.get(key)
        if rows is None or rows.shape != (count, width) or rows.dtype != like.dtype or rows.device != like.device:
            rows = torch.empty(count, width, dtype=like.dtype, device=like.device)
            if key == "a" and self.spec.has_bias:
                rows[:, -1] = 1.0
            self._buffers[key] = rows
        return rows

    @torch.no_grad()
    def compute_a(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out <- A`` (its upper triangle with ``upper_only``) from the layer's input ``x``."""
        spec, x = self.spec, x.detach()
        batch = x.shape[0]
        features = spec.a_dim - int(spec.has_bias)
        if isinstance(spec.module, nn.Conv2d):
            patches = conv_patches(spec.module, x)  # [N, features, S]
            positions = patches.shape[2]
            rows = self._rows("a", batch * positions, spec.a_dim, out)
            rows[:, :features].view(batch, positions, features).copy_(patches.transpose(1, 2))
        elif spec.has_bias or x.dtype != out.dtype:
            flat = x.reshape(-1, features)
            rows = self._rows("a", flat.shape[0], spec.a_dim, out)
            rows[:, :features].copy_(flat)
        else:
            rows = x.reshape(-1, features)
        gram_(rows, out, 1.0 / batch, self.upper_only)

    @torch.no_grad()
    def compute_g(self, grad_output: torch.Tensor, out: torch.Tensor) -> None:
        """``out <- G`` (its upper triangle with ``upper_only``) from the gradient of the loss with respect to
        the layer's output."""
        g = grad_output.detach()
        batch, outputs = g.shape[0], self.spec.g_dim
        if isinstance(self.spec.module, nn.Conv2d):
            positions = g.shape[2] * g.shape[3]
            rows = self._rows("g", batch * positions, outputs, out)
            rows.view(batch, positions, outputs).copy_(g.flatten(2).transpose(1, 2))
        elif g.dtype != out.dtype:
            rows = self._rows("g", g.numel() // outputs, outputs, out)
            rows.copy_(g.reshape(-1, outputs))
        else:
            rows = g.reshape(-1, outputs)
        positions = rows.shape[0] // batch
        # g_ns = N dL/dy_ns, so G = 1/(N S) sum (N dL/dy)(N dL/dy)^T = N/S sum dL/dy dL/dy^T.
        gram_(rows, out, batch / positions, self.upper_only)
