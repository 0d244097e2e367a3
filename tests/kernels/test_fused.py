"""Fused pack/unpack: the CPU twin against torch, the GPU twin against the CPU twin.

Without a GPU the GPU twin runs under Numba's CUDA simulator (tests/conftest.py turns
it on), on device arrays made from the same inputs as the CPU twin's.
"""

import numpy as np
import pytest
import torch
from numba import cuda

from mpisolve.kernels import fused, fused_cuda
from tests.kernels.twins import DEVICE, side_stream

THREADS = fused_cuda.THREADS


def _tensors(sizes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 100).to(dtype) for n in sizes]


@pytest.mark.parametrize(
    "sizes",
    # The last: float32 tensors over 6 chunks of CHUNK bytes (copied in parallel), pieces starting
    # and ending mid-chunk.
    [
        [],
        [0],
        [1],
        [3, 0, 5, 1],
        [7] * 300,
        [3 * fused.CHUNK // 4 + 1, 3, fused.CHUNK // 4 - 1, 0, fused.CHUNK // 2 + 1],
    ],
)
def test_cpu_pack_and_unpack_match_torch(sizes):
    tensors = _tensors(sizes)
    total = sum(sizes)
    flat = torch.full((total + 2,), -1.0)  # room to spare: the tail stays untouched
    fused.pack(tensors, flat)
    expected = torch.cat([t.view(-1) for t in tensors]) if tensors else torch.empty(0)
    assert torch.equal(flat[:total], expected)
    assert flat[total:].tolist() == [-1.0, -1.0]
    out = [torch.empty_like(t) for t in tensors]
    fused.unpack(flat, out)
    assert all(torch.equal(a, b) for a, b in zip(out, tensors))


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.bool, torch.complex128]
)
def test_cpu_pack_moves_any_dtype_bit_for_bit(dtype):
    tensors = _tensors([5, 1, 0, 9], dtype)
    tensors[0] = tensors[0].view(5, 1)  # shapes are irrelevant, only contiguity
    flat = torch.empty(15, dtype=dtype)
    fused.pack(tensors, flat)
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in tensors]))


def test_pack_refuses_what_it_would_get_wrong():
    flat = torch.empty(10)
    with pytest.raises(ValueError, match="tensor 1 has dtype torch.float64.*does not cast"):
        fused.pack([torch.zeros(2), torch.zeros(2, dtype=torch.float64)], flat)
    with pytest.raises(ValueError, match="tensor 0 is not contiguous"):
        fused.pack([torch.zeros(3, 3).t()], flat)
    with pytest.raises(ValueError, match="hold 11 elements, the flat buffer only 10"):
        fused.unpack(flat, [torch.zeros(5), torch.zeros(6)])
    with pytest.raises(ValueError, match="flat buffer must be contiguous"):
        fused.pack([torch.zeros(2)], torch.zeros(4, 2).t()[0])
    with pytest.raises(ValueError, match="tensor 0 is on meta, the flat buffer on cpu"):
        fused.pack_cpu([torch.zeros(2, device="meta")], flat)  # memcpy from a non-CPU address would crash


@pytest.mark.parametrize("numel, count", [(1000, 7), (300, 200), (5, 5), (1, 1)])
def test_bench_sizes_sum_to_numel(numel, count):
    sizes = fused.bench_sizes(numel, count)
    assert sum(sizes) == numel and len(sizes) == count and min(sizes) >= 1


def _gpu_twin_matches_cpu_twin(sizes, dtype=torch.float32, max_blocks=fused_cuda.MAX_BLOCKS):
    tensors = _tensors(sizes, dtype, seed=len(sizes))
    total = sum(sizes)
    flat = torch.zeros(total + 1, dtype=dtype)
    fused.pack(tensors, flat)
    unit = fused_cuda.copy_unit(dtype)
    starts = (fused.layout(tensors, flat)[:-1] // unit.itemsize).tolist()
    sources = [cuda.to_device(fused_cuda.as_units(t, unit).numpy()) for t in tensors]
    device_flat = cuda.to_device(np.zeros_like(fused_cuda.as_units(flat, unit).numpy()))
    fused_cuda.pack_arrays(sources, device_flat, starts, max_blocks=max_blocks)
    assert torch.equal(torch.from_numpy(device_flat.copy_to_host()).view(dtype), flat)

    targets = [cuda.to_device(np.zeros_like(fused_cuda.as_units(t, unit).numpy())) for t in tensors]
    fused_cuda.unpack_arrays(device_flat, targets, starts, max_blocks=max_blocks)
    expected = [torch.empty_like(t) for t in tensors]
    fused.unpack(flat, expected)
    for target, t in zip(targets, expected):
        assert torch.equal(torch.from_numpy(target.copy_to_host()).view(dtype).view(t.shape), t)


@pytest.mark.parametrize(
    "sizes",
    [
        [],
        [0],
        [1],
        [THREADS - 1, THREADS, THREADS + 1],  # around one block: the partial last block is masked
        [0, 1, 0, 2 * THREADS + 3, 0],
    ],
    ids=["none", "empty", "one", "around-block", "zeros-between"],
)
def test_gpu_twin_matches_cpu_twin(sizes):
    _gpu_twin_matches_cpu_twin(sizes)


def test_gpu_twin_strides_when_the_grid_is_capped():
    # Two blocks per tensor for 5 blocks' worth of elements: every thread loops over the tensor.
    _gpu_twin_matches_cpu_twin([5 * THREADS + 7, 1], max_blocks=2)


def test_gpu_twin_launches_in_groups_of_max_tensors():
    # 37 tensors: a full group of 32, then 5 padded to a tuple of 8.
    _gpu_twin_matches_cpu_twin([1 + i % 3 for i in range(fused_cuda.MAX_TENSORS + 5)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_gpu_twin_moves_other_dtypes(dtype):
    _gpu_twin_matches_cpu_twin([3, 2], dtype)


@pytest.mark.gpu
def test_pack_and_unpack_torch_cuda_tensors_on_a_side_stream():
    sizes = [0, 1, THREADS + 1, 100_003] + [5] * 40
    tensors = [t.cuda() for t in _tensors(sizes, torch.bfloat16)]
    flat = torch.empty(sum(sizes), dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        doubled = [t * 2 for t in tensors]  # produced on the side stream: pack must be ordered after it
        fused.pack(doubled, flat)
        out = [torch.empty_like(t) for t in tensors]
        fused.unpack(flat, out)
    stream.synchronize()
    assert torch.equal(flat.cpu(), torch.cat([t.cpu() * 2 for t in tensors]))
    assert all(torch.equal(a, b * 2) for a, b in zip(out, tensors))


@pytest.mark.gpu
def test_dispatch_refuses_mixed_devices():
    with pytest.raises(ValueError, match="different devices"):
        fused.pack([torch.zeros(2)], torch.zeros(2, device="cuda"))


def test_torch_facing_pack_and_unpack_match_the_cpu_twin():
    dtype = torch.bfloat16  # moved as 2-byte integers
    sizes = [0, 1, THREADS + 1, 3]
    tensors = _tensors(sizes, dtype)
    flat = torch.empty(sum(sizes), dtype=dtype)
    fused.pack_cpu([t * 2 for t in tensors], flat)
    on_device = [t.to(DEVICE) for t in tensors]
    device_flat = torch.full((sum(sizes),), -1.0, dtype=dtype, device=DEVICE)
    with side_stream():
        doubled = [t * 2 for t in on_device]  # produced on the stream the copy must follow
        fused_cuda.pack(doubled, device_flat)
        out = [torch.empty_like(t) for t in on_device]
        fused_cuda.unpack(device_flat, out)
    assert torch.equal(device_flat.cpu(), flat)
    assert all(torch.equal(o.cpu(), t * 2) for o, t in zip(out, tensors))


def test_the_torch_facing_twin_refuses_tensors_it_cannot_reach():
    with pytest.raises(ValueError, match="tensor 1 is on meta"):
        fused_cuda.pack([torch.zeros(2, device=DEVICE), torch.zeros(2, device="meta")], torch.zeros(4, device=DEVICE))
    with pytest.raises(ValueError, match="GPU kernels take CUDA tensors"):
        fused_cuda.pack([torch.zeros(2, device="meta")], torch.zeros(2, device="meta"))
