"""Adasum's kernels against a float64 numpy reference, and the CUDA twins against the CPU ones."""

import numpy as np
import pytest
import torch
from numba import config, cuda

from mpisolve.kernels import adasum, adasum_cuda
from mpisolve.kernels.adasum import TINY
from tests.kernels.twins import DEVICE, side_stream


def layout(lengths):
    return torch.tensor(np.concatenate(([0], np.cumsum(lengths))), dtype=torch.int64)


def reference_stats(a, b, bounds):
    a, b = a.double().numpy(), b.double().numpy()
    edges = bounds.tolist()
    return np.array(
        [[a[lo:hi] @ b[lo:hi], a[lo:hi] @ a[lo:hi], b[lo:hi] @ b[lo:hi]] for lo, hi in zip(edges, edges[1:])]
    ).reshape(-1, 3)


def side_counts(stats, counts):
    """The nonzero inputs under each side, decoded as the kernels' docstring says (numpy)."""
    stats, counts = np.asarray(stats, np.float64), np.asarray(counts, np.float64)
    return np.where(counts > 0, counts - 1, (stats[:, 1:3] >= TINY).astype(np.float64))


def reference_combine(a, b, bounds, stats, counts=None):
    a, b = a.double().numpy(), b.double().numpy()
    out = np.empty_like(a)
    edges = bounds.tolist()
    decoded = side_counts(stats, np.zeros((len(edges) - 1, 2)) if counts is None else counts)
    for (lo, hi), (dot, na, nb), (wa, wb) in zip(zip(edges, edges[1:]), stats.tolist(), decoded):
        share = wa / (wa + wb) if wa > 0 and wb > 0 else 0.5
        ca = 1 - share * dot / na if na >= TINY else 1.0
        cb = 1 - (1 - share) * dot / nb if nb >= TINY else 1.0
        out[lo:hi] = ca * a[lo:hi] + cb * b[lo:hi]
    return out


def coded(stats, rng):
    """Random side codes for ``stats``' segments: single inputs (0) and sides of 1 to 4 inputs (2 to 5)."""
    return torch.from_numpy(rng.choice([0.0, 2.0, 3.0, 4.0, 5.0], size=(stats.shape[0], 2)))


LENGTHS = [[], [0], [1], [5, 0, 3], [0, 0, 7, 1, 0], [1000, 1, 2, 333, 0, 4097]]


@pytest.mark.parametrize("weighed", [False, True], ids=["single inputs", "coded sides"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lengths", LENGTHS)
def test_cpu_kernels_match_numpy(lengths, dtype, weighed):
    g = torch.Generator().manual_seed(len(lengths))
    bounds = layout(lengths)
    n = int(bounds[-1])
    a, b = torch.randn(n, generator=g, dtype=dtype), torch.randn(n, generator=g, dtype=dtype)
    stats = torch.full((len(lengths), 3), 7.0, dtype=torch.float64)
    adasum.segment_stats(a, b, bounds, stats)
    np.testing.assert_allclose(stats.numpy(), reference_stats(a, b, bounds), rtol=1e-12, atol=1e-12)
    counts = coded(stats, np.random.default_rng(len(lengths))) if weighed else torch.zeros(len(lengths), 2).double()
    out = torch.empty_like(a)
    adasum.segment_combine(a, b, bounds, stats, counts, out)
    rtol = 1e-6 if dtype == torch.float32 else 1e-12
    expected = reference_combine(a, b, bounds, stats, counts.numpy())
    np.testing.assert_allclose(out.double().numpy(), expected, rtol=rtol, atol=rtol)
    codes = adasum.combined_codes(stats, counts, torch.full((len(lengths),), 9.0, dtype=torch.float64))
    np.testing.assert_array_equal(codes.numpy(), side_counts(stats.numpy(), counts.numpy()).sum(axis=1) + 1)


def test_parallel_segments_give_their_mean_weighted_by_inputs():
    bounds = layout([5, 3, 2])
    a = torch.tensor([1.0, -2, 3, 0.5, 4, 1, 1, 1, 2, 2], dtype=torch.float64)
    b = torch.cat((-3.0 * a[:5], 0.25 * a[5:8], 0 * a[8:]))
    stats = adasum.segment_stats(a, b, bounds, torch.empty(3, 3, dtype=torch.float64))
    # Segment 0: 2 inputs against 1; segment 1: 1 against 3; segment 2: 4 against 3 whose sum is zero.
    counts = torch.tensor([[3.0, 0.0], [0.0, 4.0], [5.0, 4.0]], dtype=torch.float64)
    out = adasum.segment_combine(a, b, bounds, stats, counts, torch.empty_like(a))
    expected = torch.cat(((2 * a[:5] + b[:5]) / 3, (a[5:8] + 3 * b[5:8]) / 4, a[8:]))
    np.testing.assert_allclose(out.numpy(), expected.numpy(), rtol=1e-14, atol=1e-14)
    codes = adasum.combined_codes(stats, counts, torch.empty(3, dtype=torch.float64))
    # 3, 4 and 7 nonzero inputs under the pairs, coded plus one: a side counts its inputs even where they cancel
    assert codes.tolist() == [4.0, 5.0, 8.0]


def test_combine_guard_and_in_place():
    bounds = layout([3, 3, 3])
    a = torch.tensor([0.0, 0, 0, 1, 2, 3, 1e-160, 0, 0], dtype=torch.float64)
    b = torch.tensor([1.0, 2, 3, 0, 0, 0, 2, 0, 0], dtype=torch.float64)
    stats = adasum.segment_stats(a, b, bounds, torch.empty(3, 3, dtype=torch.float64))
    expected = reference_combine(a, b, bounds, stats)
    adasum.segment_combine(a, b, bounds, stats, torch.zeros(3, 2, dtype=torch.float64), a)  # out aliases a
    np.testing.assert_array_equal(a.numpy(), expected)
    # a zero segment and a tiny one pass through as a plain sum
    np.testing.assert_array_equal(a.numpy()[:3], [1, 2, 3])
    np.testing.assert_array_equal(a.numpy()[3:6], [1, 2, 3])


def test_identical_and_orthogonal_segments_are_exact():
    bounds = layout([4, 4])
    a = torch.tensor([1.0, -2, 3, 0.5, 1, 0, 0, 0], dtype=torch.float32)
    b = torch.tensor([1.0, -2, 3, 0.5, 0, 1, 0, 0], dtype=torch.float32)
    stats = adasum.segment_stats(a, b, bounds, torch.empty(2, 3, dtype=torch.float64))
    out = adasum.segment_combine(a, b, bounds, stats, torch.zeros(2, 2, dtype=torch.float64), torch.empty_like(a))
    assert out.tolist() == [1.0, -2, 3, 0.5, 1, 1, 0, 0]


def test_bad_arguments_are_named():
    a = torch.zeros(4)
    with pytest.raises(ValueError, match="stats must be float64 of shape"):
        adasum.segment_stats(a, a, layout([4]), torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="a and b must be flat tensors"):
        adasum.segment_stats(
            a, torch.zeros(4, dtype=torch.float64), layout([4]), torch.zeros(1, 3, dtype=torch.float64)
        )
    stats = torch.zeros(1, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"counts must be float64 of shape \(1, 2\)"):
        adasum.segment_combine(a, a, layout([4]), stats, torch.zeros(1, 3, dtype=torch.float64), a)
    with pytest.raises(ValueError, match=r"out must be float64 of shape \(1,\)"):
        adasum.combined_codes(stats, torch.zeros(1, 2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))


def test_bench_cases_run():
    for case in adasum.bench_cases(1000):
        case.kernel()
        case.reference()


# ------------------------------------------------------------ CUDA twins
needs_cuda = pytest.mark.skipif(
    not (config.ENABLE_CUDASIM or cuda.is_available()), reason="needs a GPU or NUMBA_ENABLE_CUDASIM=1"
)
TILE = adasum_cuda.THREADS * adasum_cuda.ITEMS


@needs_cuda
@pytest.mark.parametrize(
    "lengths",
    [[], [0], [1], [TILE - 1], [TILE], [TILE + 1], [7, 0, TILE - 7, 1, 0, adasum_cuda.THREADS + 3], [0, 1] * 40 + [5]],
    ids=lambda lengths: f"{len(lengths)}seg-{sum(lengths)}",
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cuda_twins_match_cpu(lengths, dtype):
    rng = np.random.default_rng(sum(lengths) + len(lengths))
    bounds = layout(lengths)
    n = int(bounds[-1])
    a = torch.from_numpy(rng.standard_normal(n).astype(dtype))
    b = torch.from_numpy(rng.standard_normal(n).astype(dtype))
    stats = adasum.segment_stats(a, b, bounds, torch.empty(len(lengths), 3, dtype=torch.float64))
    counts = coded(stats, rng)
    out = adasum.segment_combine(a, b, bounds, stats, counts, torch.empty_like(a))

    d_a, d_b, d_bounds = cuda.to_device(a.numpy()), cuda.to_device(b.numpy()), cuda.to_device(bounds.numpy())
    d_stats = cuda.to_device(np.zeros((len(lengths), 3)))
    adasum_cuda.stats_arrays(d_a, d_b, d_bounds, d_stats)
    np.testing.assert_allclose(d_stats.copy_to_host(), stats.numpy(), rtol=1e-12, atol=1e-12)
    d_out = cuda.to_device(np.zeros(n, dtype=dtype))
    adasum_cuda.combine_arrays(d_a, d_b, d_bounds, cuda.to_device(stats.numpy()), cuda.to_device(counts.numpy()), d_out)
    rtol = 1e-6 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(d_out.copy_to_host(), out.numpy(), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_facing_twins_match_the_cpu_twins(dtype):
    lengths = [7, 0, 300, 1]
    gen = torch.Generator().manual_seed(4)
    a, b = (torch.randn(sum(lengths), generator=gen, dtype=dtype) for _ in range(2))
    bounds = layout(lengths)
    stats = adasum.segment_stats_cpu(a, b, bounds, torch.empty(len(lengths), 3, dtype=torch.float64))
    counts = coded(stats, np.random.default_rng(4))
    out = adasum.segment_combine_cpu(a, b, bounds, stats, counts, torch.empty_like(a))
    codes = adasum.combined_codes_cpu(stats, counts, torch.empty(len(lengths), dtype=torch.float64))
    d_a, d_b, d_bounds = a.to(DEVICE), b.to(DEVICE), bounds.to(DEVICE)
    with side_stream():
        d_stats = adasum_cuda.segment_stats(d_a * 1, d_b * 1, d_bounds, torch.full_like(stats, 7.0, device=DEVICE))
        d_counts = counts.to(DEVICE)
        d_out = adasum_cuda.segment_combine(d_a, d_b, d_bounds, d_stats, d_counts, d_a)  # in place, as Adasum combines
        d_codes = adasum_cuda.combined_codes(
            d_stats, d_counts, torch.empty(len(lengths), dtype=torch.float64, device=DEVICE)
        )
    np.testing.assert_allclose(d_stats.cpu().numpy(), stats.numpy(), rtol=1e-12, atol=1e-12)
    rtol = 1e-6 if dtype == torch.float32 else 1e-13
    np.testing.assert_allclose(d_out.cpu().numpy(), out.numpy(), rtol=rtol, atol=rtol)
    assert d_out is d_a
    np.testing.assert_array_equal(d_codes.cpu().numpy(), codes.numpy())
