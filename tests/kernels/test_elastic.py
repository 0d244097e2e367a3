"""The elastic kernels against the update equations in torch, and the CUDA twin against the CPU one."""

import numpy as np
import pytest
import torch
from numba import cuda

from mpisolve.kernels.elastic import bench_cases, elastic_exchange_
from tests.kernels.twins import DEVICE, side_stream


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exchange_matches_the_equations(dtype):
    gen = torch.Generator().manual_seed(1)
    x, center = torch.randn(1001, generator=gen, dtype=dtype), torch.randn(1001, generator=gen, dtype=dtype)
    d = 0.3 * (x - center)
    want_x, want_center = x - d, center + d
    elastic_exchange_(x, center, 0.3)
    torch.testing.assert_close(x, want_x)
    torch.testing.assert_close(center, want_center)
    # the exchange conserves x + center (up to rounding)
    torch.testing.assert_close(x + center, want_x + want_center)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="one shape and dtype"):
        elastic_exchange_(torch.zeros(3), torch.zeros(4), 0.1)
    with pytest.raises(ValueError, match="one shape and dtype"):
        elastic_exchange_(torch.zeros(3), torch.zeros(3, dtype=torch.float64), 0.1)


def test_bench_cases_run_both_sides():
    for case in bench_cases(64):
        case.kernel()
        case.reference()


@pytest.mark.parametrize("n", [1, 300, 1025])
def test_cuda_twin_matches_cpu_on_arrays(n):
    from mpisolve.kernels import elastic_cuda

    rng = np.random.default_rng(n)
    x, center = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    xt, ct = torch.from_numpy(x.copy()), torch.from_numpy(center.copy())
    elastic_exchange_(xt, ct, 0.2)
    d_x, d_center = cuda.to_device(x), cuda.to_device(center)
    elastic_cuda.launch_exchange(d_x, d_center, 0.2)
    # A GPU may fuse x - alpha (x - center) into one multiply-add (one rounding, not two): where
    # the result nearly cancels, the twins differ by a few ulps of the operands, not of the result.
    atol = 4 * np.finfo(np.float32).eps * max(np.abs(x).max(), np.abs(center).max())
    np.testing.assert_allclose(d_x.copy_to_host(), xt.numpy(), rtol=1e-6, atol=atol)
    np.testing.assert_allclose(d_center.copy_to_host(), ct.numpy(), rtol=1e-6, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_facing_twin_matches_cpu(dtype):
    from mpisolve.kernels import elastic_cuda

    gen = torch.Generator().manual_seed(3)
    x, center = torch.randn(700, generator=gen, dtype=dtype), torch.randn(700, generator=gen, dtype=dtype)
    d_x, d_center = x.to(DEVICE), center.to(DEVICE)
    elastic_exchange_(x, center, 0.3)
    with side_stream():
        d_x.mul_(1.0)  # written on the stream the exchange must follow
        elastic_cuda.elastic_exchange_(d_x, d_center, 0.3)
    torch.testing.assert_close(d_x.cpu(), x)
    torch.testing.assert_close(d_center.cpu(), center)
    with pytest.raises(ValueError, match="one shape and dtype"):
        elastic_cuda.elastic_exchange_(d_x, d_center[:3], 0.3)
