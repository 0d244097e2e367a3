"""K-FAC factors against dense references: the empirical Fisher block, KFC patches, scaling."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mpisolve.errors import OptionError
from mpisolve.solvers.kfac.factors import FactorComputer, find_layers


def capture(layer, x, loss_fn):
    """One forward/backward: the factors, the gradient matrix [out, in(+1)] and dL/dy."""
    spec = find_layers(nn.Sequential(layer))[0]
    computer = FactorComputer(spec)
    a = torch.empty(spec.a_dim, spec.a_dim, dtype=x.dtype)
    g = torch.empty(spec.g_dim, spec.g_dim, dtype=x.dtype)
    y = layer(x)
    y.retain_grad()
    computer.compute_a(x, a)
    y.register_hook(lambda grad: computer.compute_g(grad, g))
    layer.zero_grad()
    loss_fn(y).backward()
    grad = layer.weight.grad.reshape(spec.g_dim, -1)
    if spec.has_bias:
        grad = torch.cat([grad, layer.bias.grad[:, None]], dim=1)
    return a, g, grad, y


def column_vec(matrix):
    return matrix.T.reshape(-1)


@pytest.mark.parametrize("bias", [True, False])
def test_one_example_linear_kronecker_product_is_the_empirical_fisher_block(bias):
    torch.manual_seed(0)
    layer = nn.Linear(4, 3, bias=bias).double()
    x = torch.randn(1, 4, dtype=torch.float64)
    target = torch.randn(1, 3, dtype=torch.float64)
    a, g, grad, _ = capture(layer, x, lambda y: ((y.tanh() - target) ** 2).mean())
    v = column_vec(grad)
    torch.testing.assert_close(torch.kron(a, g), torch.outer(v, v), rtol=1e-12, atol=1e-14)


def test_one_example_conv_with_one_position_is_exact_too():
    torch.manual_seed(1)
    layer = nn.Conv2d(2, 3, 3).double()  # a 3x3 input: one output position
    x = torch.randn(1, 2, 3, 3, dtype=torch.float64)
    a, g, grad, _ = capture(layer, x, lambda y: (y.sin() ** 2).sum())
    v = column_vec(grad)
    torch.testing.assert_close(torch.kron(a, g), torch.outer(v, v), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "kwargs", [dict(stride=2, padding=1), dict(dilation=2, padding="same"), dict(padding=1, padding_mode="reflect")]
)
def test_conv_factors_follow_the_kfc_convention(kwargs):
    torch.manual_seed(2)
    layer = nn.Conv2d(2, 4, 3, **kwargs).double()
    x = torch.randn(3, 2, 7, 7, dtype=torch.float64)
    a, g, grad, y = capture(layer, x, lambda y: (y**2).mean())
    n, positions = x.shape[0], y.shape[2] * y.shape[3]
    mode = "reflect" if layer.padding_mode == "reflect" else "constant"
    padded = F.pad(x, layer._reversed_padding_repeated_twice, mode=mode)
    patches = F.unfold(padded, layer.kernel_size, dilation=layer.dilation, stride=layer.stride)  # [N, C*kh*kw, S]
    weight = layer.weight.reshape(4, -1)
    torch.testing.assert_close((weight @ patches + layer.bias[:, None]).view_as(y), y)  # patch order = weight order
    abar = torch.cat([patches, torch.ones(n, 1, positions, dtype=torch.float64)], dim=1)
    per_example = n * y.grad.flatten(2)  # g = N dL/dy for a batch-mean loss
    torch.testing.assert_close(a, torch.einsum("nis,njs->ij", abar, abar) / n)
    torch.testing.assert_close(g, torch.einsum("nis,njs->ij", per_example, per_example) / (n * positions))
    # The gradient matrix is sum_{n,s} dL/dy_ns abar_ns^T: the factors see the same rows.
    torch.testing.assert_close(grad, torch.einsum("nis,njs->ij", y.grad.flatten(2), abar))


def test_linear_on_sequences_pools_positions_like_a_convolution():
    torch.manual_seed(3)
    layer = nn.Linear(3, 2).double()
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    a, g, _, y = capture(layer, x, lambda y: (y**3).mean())
    xbar = torch.cat([x, torch.ones(4, 5, 1, dtype=torch.float64)], dim=2).reshape(-1, 4)
    torch.testing.assert_close(a, xbar.T @ xbar / 4)
    per_example = 4 * y.grad.reshape(-1, 2)
    torch.testing.assert_close(g, per_example.T @ per_example / (4 * 5))


def test_find_layers_skips_by_name_class_and_type_and_leaves_grouped_convs():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.Conv2d(4, 4, 3, groups=2),
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, bias=False)),
        nn.Linear(4, 2),
    )
    model[4].weight.requires_grad_(False)
    names = [s.name for s in find_layers(model)]
    assert names == ["0", "3.0", "3.1"]
    assert [s.name for s in find_layers(model, skip=("3",))] == ["0"]
    assert [s.name for s in find_layers(model, skip=(nn.Conv2d,))] == ["3.0", "3.1"]
    assert [s.name for s in find_layers(model, skip=["Linear"])] == ["0"]
    with pytest.raises(OptionError, match=r"match no module of the model: 'fc', Embedding"):
        find_layers(model, skip=("3", "fc", nn.Embedding))
    specs = {s.name: s for s in find_layers(model)}
    assert (specs["0"].a_dim, specs["0"].g_dim, specs["3.1"].a_dim) == (3 * 9 + 1, 4, 4)


@pytest.mark.parametrize(
    "layer, x",
    [
        (nn.Conv2d(64, 130, 3, padding=1), torch.randn(2, 64, 5, 5)),  # A 577 (4 block rows, uneven), G 130 (1)
        (nn.Linear(300, 260, bias=False), torch.randn(7, 300)),  # A 300 (2 block rows), G 260 (2)
    ],
    ids=["conv", "linear"],
)
def test_upper_only_factors_are_the_upper_triangles_of_the_full_products(layer, x):
    """Packed factors are computed in block rows right of the diagonal: the upper triangle
    matches a dense reference, and below it nothing is written (the saved work)."""
    torch.manual_seed(4)
    layer, x = layer.double(), x.double()
    spec = find_layers(nn.Sequential(layer))[0]
    computer = FactorComputer(spec, upper_only=True)
    a = torch.full((spec.a_dim, spec.a_dim), float("nan"), dtype=torch.float64)
    g = torch.full((spec.g_dim, spec.g_dim), float("nan"), dtype=torch.float64)
    y = layer(x)
    computer.compute_a(x, a)
    y.register_hook(lambda grad: computer.compute_g(grad, g))
    y.retain_grad()
    (y**2).mean().backward()
    n = x.shape[0]
    if isinstance(layer, nn.Conv2d):
        patches = F.unfold(x, 3, padding=1)
        abar = torch.cat([patches, torch.ones(n, 1, patches.shape[2], dtype=torch.float64)], dim=1)
        a_ref = torch.einsum("nis,njs->ij", abar, abar) / n
        per_example = n * y.grad.flatten(2)
        g_ref = torch.einsum("nis,njs->ij", per_example, per_example) / (n * per_example.shape[2])
    else:
        a_ref = x.T @ x / n
        g_ref = (n * y.grad).T @ (n * y.grad) / n
    for got, ref in ((a, a_ref), (g, g_ref)):
        upper = torch.ones_like(ref, dtype=torch.bool).triu()
        torch.testing.assert_close(got[upper], ref[upper])
        if ref.shape[0] >= 2 * 128:  # split into block rows: the far lower-left block is never computed
            assert got[-1, 0].isnan()
