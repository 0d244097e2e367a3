"""The batched inversion kernel: results, statuses and fallbacks, and the GPU twin's algorithm."""

import numpy as np
import pytest
import torch

from mpisolve.kernels.inverse import FAILED, OK, RECOVERED, bench_cases, eigh_psd, eigh_psd_, inverse_spd_, invert_spd
from mpisolve.kernels.inverse_cuda import XpLinalg


def spd_stack(batch, n, dtype=torch.float64, seed=0):
    x = torch.randn(batch, n, 2 * n, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return x @ x.transpose(1, 2) / (2 * n)


def cpu_inverse(stack, shifts):
    return inverse_spd_(stack, shifts)


def numpy_inverse(stack, shifts):  # the CuPy twin's code path, numpy standing in for CuPy
    return invert_spd(stack, shifts, XpLinalg(np))


def cpu_eigh(stack, values):
    return eigh_psd_(stack, values)


def numpy_eigh(stack, values):
    return eigh_psd(stack, values, XpLinalg(np))


@pytest.mark.parametrize("invert", [cpu_inverse, numpy_inverse])
def test_batched_inverse_matches_dense_inverse_and_flags_bad_matrices(invert):
    source = spd_stack(5, 6)
    source[1] = 0.0  # singular, and no shift: no inverse
    source[2, 0, 0] = float("nan")
    source[3] = torch.outer(source[3, 0], source[3, 0])  # rank one, but shifted: fine
    shifts = [1e-3, 0.0, 1e-3, 0.5, 1e-2]
    stack = source.clone()
    status = invert(stack, shifts)
    assert status.tolist()[:3] == [OK, FAILED, FAILED] and status[4] == OK and status[3] in (OK, RECOVERED)
    eye = torch.eye(6, dtype=torch.float64)
    for i in (0, 3, 4):
        torch.testing.assert_close(stack[i], torch.linalg.inv(source[i] + shifts[i] * eye))
    for i in (1, 2):
        torch.testing.assert_close(stack[i], eye)  # failed: the identity, never NaN


@pytest.mark.parametrize("invert", [cpu_inverse, numpy_inverse])
def test_float32_cholesky_failure_is_recovered_by_float64_eigh(invert):
    v = torch.randn(8, generator=torch.Generator().manual_seed(1))
    source = (torch.outer(v, v) * 1e4).unsqueeze(0)  # rank one: singular in float32 next to 1e-6
    stack = source.clone()
    status = invert(stack, [1e-6])
    assert status.tolist() == [RECOVERED]
    result = stack[0].double()
    torch.testing.assert_close(result, result.T)
    spectrum = torch.linalg.eigvalsh(result)
    # Bounded by the damping, and positive semi-definite up to float32 round-off.
    assert spectrum.max() <= 1e6 * (1 + 1e-5) and spectrum.min() > -1e-7 * spectrum.max()
    assert spectrum.max() > 1e5  # the damped directions are really there


@pytest.mark.parametrize("eigh", [cpu_eigh, numpy_eigh])
def test_batched_eigh_reconstructs_and_flags_non_finite(eigh):
    source = spd_stack(4, 5)
    source[2, 1, 3] = float("inf")
    stack = source.clone()
    values = torch.empty(4, 5, dtype=torch.float64)
    status = eigh(stack, values)
    assert status.tolist() == [OK, OK, FAILED, OK]
    assert (values >= 0).all()
    for i in (0, 1, 3):
        torch.testing.assert_close(stack[i] @ torch.diag(values[i]) @ stack[i].T, source[i])
    torch.testing.assert_close(stack[2], torch.eye(5, dtype=torch.float64))
    torch.testing.assert_close(values[2], torch.ones(5, dtype=torch.float64))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="B shifts"):
        inverse_spd_(torch.zeros(2, 3, 3), [0.1])
    with pytest.raises(ValueError, match="values"):
        eigh_psd_(torch.zeros(2, 3, 3), torch.zeros(3, 3))


def test_bench_cases_run():
    for case in bench_cases(20_000):
        case.kernel()
        case.reference()
    assert {c.name.split()[0] for c in bench_cases(20_000)} == {"inverse_spd", "eigh_psd"}


@pytest.mark.gpu
def test_cuda_tensors_are_inverted_on_torch_s_current_stream():
    source = spd_stack(3, 40)
    source[1, 0, 0] = float("nan")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        stack = source.cuda() * 2  # produced on the side stream: the CuPy work must follow it
        status = inverse_spd_(stack, [1e-3] * 3)
        values = torch.empty(3, 40, dtype=torch.float64, device="cuda")
        vectors = source.cuda() * 2
        eigh_status = eigh_psd_(vectors, values)
    stream.synchronize()
    expected = source * 2
    assert cpu_inverse(expected.clone(), [1e-3] * 3).tolist() == status.tolist() == [OK, FAILED, OK]
    for i in (0, 2):
        torch.testing.assert_close(
            stack[i].cpu(), torch.linalg.inv(expected[i] + 1e-3 * torch.eye(40, dtype=torch.float64))
        )
        torch.testing.assert_close((vectors[i] @ torch.diag(values[i]) @ vectors[i].T).cpu(), expected[i])
    assert eigh_status.tolist() == [OK, FAILED, OK]
