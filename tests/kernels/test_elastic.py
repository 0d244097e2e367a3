"""The elastic kernels against the update equations in torch, and the CUDA twin against the CPU one."""

import numba
import numpy as np
import pytest
import torch

from mpisolve.kernels.elastic import bench_cases, elastic_exchange_


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


@pytest.mark.skipif(not numba.config.ENABLE_CUDASIM, reason="needs NUMBA_ENABLE_CUDASIM=1 (make test-serial sets it)")
@pytest.mark.parametrize("n", [1, 300, 1025])
def test_cuda_twin_matches_cpu_under_the_simulator(n):
    from mpisolve.kernels import elastic_cuda

    rng = np.random.default_rng(n)
    x, center = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    xt, ct = torch.from_numpy(x.copy()), torch.from_numpy(center.copy())
    elastic_exchange_(xt, ct, 0.2)
    elastic_cuda.launch_exchange(x, center, 0.2)
    np.testing.assert_allclose(x, xt.numpy(), rtol=1e-6)
    np.testing.assert_allclose(center, ct.numpy(), rtol=1e-6)
