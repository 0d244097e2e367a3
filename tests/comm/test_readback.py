"""The one place where the host reads device values: what it reads, and that it counts."""

from __future__ import annotations

import math

import numpy as np
import torch

from mpisolve.comm import readback
from mpisolve.comm.readback import (
    Readback,
    finite_probe,
    host_finite_probe,
    host_reads,
    read,
    read_finite_probe,
    reading,
    write_finite_probe,
)


def test_a_fetch_returns_what_the_device_wrote_and_counts_once():
    readback = Readback(3)
    readback.values[0].fill_(7.0)
    readback.values[1:].copy_(torch.tensor([2.5, -1.0]))
    before = host_reads()
    assert list(readback.fetch()) == [7.0, 2.5, -1.0]
    assert host_reads() == before + 1


def test_a_one_off_read_counts_and_is_marked_as_a_read_while_it_runs():
    before = host_reads()
    assert read(torch.tensor([[1.0, 2.0]], dtype=torch.float32)) == [1.0, 2.0]
    assert host_reads() == before + 1 and not reading()


def test_the_finite_probe_is_finite_exactly_when_every_element_is():
    one = [torch.tensor([1.0, -3.0])]
    several = [*one, torch.tensor([[2.0]], dtype=torch.float64), torch.empty(0)]
    half = [*one, torch.tensor([60000.0, 60000.0], dtype=torch.float16)]  # summed in float32: no overflow
    for tensors in (one, several, half):
        assert math.isfinite(finite_probe(tensors).item())
        for bad in (float("nan"), float("inf"), -float("inf")):
            assert not math.isfinite(finite_probe([*tensors, torch.tensor([0.0, bad])]).item())
            assert not math.isfinite(finite_probe([torch.tensor([bad, 1.0]), *tensors]).item())
    assert finite_probe([]).item() == 0.0 and finite_probe([torch.empty(0)]).item() == 0.0
    out = torch.zeros(2, dtype=torch.float64)
    write_finite_probe([torch.tensor([-5.0])], out[1])
    assert out.tolist() == [0.0, -5.0]


def test_on_the_cpu_the_host_adds_the_sums_itself_and_a_read_of_them_counts_once():
    tensors = [
        torch.tensor([1.0, -3.0]),
        torch.tensor([[2.0]], dtype=torch.float64),
        torch.empty(0),
        torch.tensor([60000.0, 60000.0], dtype=torch.float16),  # summed in float32: no overflow
    ]
    want = sum(float(np.sum(t.numpy(), dtype=np.float64)) for t in tensors)
    assert host_finite_probe(tensors) == want == 120000.0
    before = host_reads()
    assert read_finite_probe(tensors) == want
    assert host_reads() == before + 1
    out = torch.zeros(2, dtype=torch.float64)
    write_finite_probe(tensors, out[1])
    assert out.tolist() == [0.0, want]
    for bad in (float("nan"), float("inf"), -float("inf")):
        for at in range(len(tensors) + 1):
            with_bad = [*tensors[:at], torch.tensor([0.0, bad]), *tensors[at:]]
            assert not math.isfinite(host_finite_probe(with_bad))
            assert not math.isfinite(read_finite_probe(with_bad))
    assert host_finite_probe([]) == 0.0 and read_finite_probe([torch.empty(0)]) == 0.0
    assert not reading()
    with readback._read(torch.device("cpu")):  # inside a counted read, it stays one
        host_finite_probe(tensors)
        assert reading()
