"""Upper-triangle packing: round trips on the CPU twin and on the GPU twin's kernels."""

import numba
import pytest
import torch

from mpisolve.kernels.triangle import bench_cases, pack_triu, triangle_numel, unpack_triu_


@pytest.mark.parametrize("n", [1, 2, 17, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pack_unpack_round_trip(n, dtype):
    x = torch.randn(n, n + 3, dtype=dtype)
    symmetric = x @ x.T
    packed = torch.empty(triangle_numel(n), dtype=dtype)
    assert pack_triu(symmetric, packed) is packed
    rows, cols = torch.triu_indices(n, n)
    assert torch.equal(packed, symmetric[rows, cols])  # row-major upper triangle, diagonal included
    out = torch.full((n, n), float("nan"), dtype=dtype)
    unpack_triu_(packed, out)
    assert torch.equal(out, symmetric)


def test_wrong_sizes_are_refused():
    with pytest.raises(ValueError, match="6 elements"):
        pack_triu(torch.zeros(3, 3), torch.zeros(5))
    with pytest.raises(ValueError, match="square"):
        unpack_triu_(torch.zeros(6), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="dtype"):
        unpack_triu_(torch.zeros(6, dtype=torch.float64), torch.zeros(3, 3))


@pytest.mark.skipif(not numba.config.ENABLE_CUDASIM, reason="runs the CUDA kernels under NUMBA_ENABLE_CUDASIM=1")
def test_gpu_twin_kernels_agree_with_the_cpu_twin():
    from mpisolve.kernels.triangle_cuda import launch_pack, launch_unpack

    n = 19  # more than one 16 x 16 block
    x = torch.randn(n, n, dtype=torch.float64)
    symmetric = x + x.T
    packed = torch.empty(triangle_numel(n), dtype=torch.float64)
    launch_pack(symmetric.numpy(), packed.numpy())
    assert torch.equal(packed, pack_triu(symmetric, torch.empty_like(packed)))
    out = torch.zeros(n, n, dtype=torch.float64)
    launch_unpack(packed.numpy(), out.numpy())
    assert torch.equal(out, symmetric)


def test_bench_cases_run():
    pack, unpack = bench_cases(400)
    pack.kernel()
    unpack.kernel()
    unpack.reference()
    pack.reference()
