"""Upper-triangle packing: round trips on the CPU twin and on the GPU twin's kernels."""

import numpy as np
import pytest
import torch
from numba import config, cuda

from mpisolve.kernels.triangle import bench_cases, pack_triu, triangle_numel, unpack_triu_
from tests.kernels.twins import DEVICE, side_stream


@pytest.mark.parametrize("n", [1, 2, 17, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pack_unpack_round_trip(n, dtype):
    x = torch.randn(n, n + 3, dtype=dtype)
    gram = x @ x.T  # not bit-symmetric on every CPU: its BLAS kernel varies (AVX2, AVX-512)
    symmetric = gram + gram.T  # bit-symmetric: addition commutes
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


@pytest.mark.skipif(not (config.ENABLE_CUDASIM or cuda.is_available()), reason="needs a GPU or NUMBA_ENABLE_CUDASIM=1")
@pytest.mark.parametrize("n", [1, 19])  # 19: more than one 16 x 16 block
def test_gpu_twin_kernels_agree_with_the_cpu_twin(n):
    from mpisolve.kernels.triangle_cuda import pack_arrays, unpack_arrays

    x = torch.randn(n, n, dtype=torch.float64)
    symmetric = x + x.T
    d_packed = cuda.to_device(np.zeros(triangle_numel(n)))
    pack_arrays(cuda.to_device(symmetric.numpy()), d_packed)
    packed = torch.from_numpy(d_packed.copy_to_host())
    assert torch.equal(packed, pack_triu(symmetric, torch.empty_like(packed)))
    d_out = cuda.to_device(np.zeros((n, n)))
    unpack_arrays(d_packed, d_out)
    assert torch.equal(torch.from_numpy(d_out.copy_to_host()), symmetric)


def test_torch_facing_twin_packs_and_unpacks_on_torch_s_stream():
    from mpisolve.kernels import triangle_cuda

    n = 19  # more than one 16 x 16 block
    x = torch.randn(n, n, dtype=torch.float64)
    symmetric = (x + x.T).to(DEVICE)
    with side_stream():
        doubled = symmetric * 2  # produced on the stream: packing must be ordered after it
        packed = triangle_cuda.pack_triu(doubled, torch.empty(triangle_numel(n), dtype=torch.float64, device=DEVICE))
        out = triangle_cuda.unpack_triu_(packed, torch.empty_like(doubled))
    assert torch.equal(
        packed.cpu(), pack_triu(symmetric.cpu() * 2, torch.empty(triangle_numel(n), dtype=torch.float64))
    )
    assert torch.equal(out.cpu(), symmetric.cpu() * 2)


def test_bench_cases_run():
    pack, unpack = bench_cases(400)
    pack.kernel()
    unpack.kernel()
    unpack.reference()
    pack.reference()
