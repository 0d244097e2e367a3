"""The slot-sum kernel against numpy summing the same rows in the documented order."""

import numpy as np
import pytest
import torch

from mpisolve.kernels.slots import host_rows, slot_sum


def ordered_sum(rows: torch.Tensor, start: int, stop: int, acc: torch.dtype, scale: float) -> torch.Tensor:
    """numpy: row 0, then each further row added in order, in ``acc``; then one multiply."""
    wide = rows.to(acc).numpy()
    total = wide[0, start:stop].copy()
    for r in range(1, wide.shape[0]):
        total += wide[r, start:stop]
    if scale != 1.0:
        total *= np.array(scale, dtype=total.dtype)
    return torch.from_numpy(total)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("ranks", [1, 2, 5])
@pytest.mark.parametrize("scale", [1.0, 0.2])
def test_equals_the_ordered_sum_bit_for_bit(dtype, ranks, scale):
    g = torch.Generator().manual_seed(ranks)
    rows = (torch.randn(ranks, 5000, generator=g) * 100).to(dtype)
    rows[0, :4] = torch.tensor([float("inf"), -0.0, 1e-6, -3.5]).to(dtype)  # inf, signed zero, half subnormal
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.full((5000,), -7.0, dtype=acc)
    slot_sum(host_rows(rows), 3, 4500, out.numpy(), scale, brain=dtype == torch.bfloat16)()
    assert torch.equal(out[3:4500], ordered_sum(rows, 3, 4500, acc, scale))
    assert (out[:3] == -7).all() and (out[4500:] == -7).all()  # nothing outside the range is written


def test_every_float16_pattern_widens_exactly():
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    out = torch.empty(65536)
    slot_sum(host_rows(patterns.view(1, -1)), 0, 65536, out.numpy())()
    want = patterns.float()
    assert torch.equal(out.isnan(), want.isnan())
    keep = ~want.isnan()
    assert torch.equal(out[keep].view(torch.int32), want[keep].view(torch.int32))


def test_bad_ranges_and_dtypes_are_named():
    rows = host_rows(torch.zeros(2, 10))
    with pytest.raises(ValueError, match="range 0:11"):
        slot_sum(rows, 0, 11, np.zeros(11, np.float32))
    with pytest.raises(TypeError, match="float64"):
        slot_sum(rows, 0, 10, np.zeros(10, np.float64))
    with pytest.raises(TypeError, match="half rows sum into float32"):
        slot_sum(host_rows(torch.zeros(2, 10, dtype=torch.float16)), 0, 10, np.zeros(10, np.float16))
