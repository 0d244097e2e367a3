"""Emulated heterogeneity: presets, factor lists, and the measured stretch."""

import statistics
import time

import pytest
import torch

from mpisolve.errors import InputError
from mpisolve.train.hetero import PRESETS, Slowdown, factors_for_world, moving_factor, parse_hetero


def test_presets_and_lists():
    assert parse_hetero("two-tier") == ("two-tier", PRESETS["two-tier"])
    assert parse_hetero("1,1.5,2") == (None, (1.0, 1.5, 2.0))
    assert parse_hetero([1, 4]) == (None, (1.0, 4.0))
    assert factors_for_world("graded", PRESETS["graded"], 6) == PRESETS["graded"] + PRESETS["graded"][:2]
    assert factors_for_world(None, (1.0, 2.0), 2) == (1.0, 2.0)
    with pytest.raises(InputError, match="2 factors for 3 ranks"):
        factors_for_world(None, (1.0, 2.0), 3)
    for bad in ("1,x", "0.5", "inf", ""):
        with pytest.raises(InputError):
            parse_hetero(bad)


def test_a_factor_of_three_takes_three_times_the_compute():
    """Each micro-batch's whole time against its own measured compute, as the trainer stretches it."""
    torch.manual_seed(0)
    a = torch.randn(192, 192)
    slow = Slowdown(3.0)
    ratios = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(20):
            a @ a
        compute = time.perf_counter() - start
        slow.stretch(compute, 1)
        ratios.append((time.perf_counter() - start) / compute)
    assert 2.7 < statistics.median(ratios) < 3.6, ratios


def test_an_emulated_device_takes_factor_times_samples_times_its_time_whatever_the_compute():
    """With a device time, the stretch tops the real compute up to factor x samples x time, and counts overruns."""
    slow = Slowdown(2.0, device_s_per_sample=0.004)
    start = time.perf_counter()
    slow.stretch(0.001, 5)  # 1 ms of real compute on 5 samples: 2 x 5 x 4 ms = 40 ms in all
    assert time.perf_counter() - start >= 0.039 and slow.overruns == 0
    start = time.perf_counter()
    slow.stretch(0.5, 5)  # real compute beyond the device's 40 ms: no sleep, one overrun
    assert time.perf_counter() - start < 0.039 and (slow.overruns, slow.batches) == (1, 2)
    with pytest.raises(InputError, match="time per sample must be > 0"):
        Slowdown(1.0, device_s_per_sample=0.0)


def test_a_moving_cluster_passes_each_factor_to_the_next_rank_every_period_from_the_start():
    straggler = PRESETS["straggler"]  # rank 3 is 4x slower at the start
    start = 1000.0
    at = [
        [moving_factor(straggler, rank, 2.0, start, now_s=start + t) for rank in range(4)]
        for t in (0.0, 1.9, 2.0, 5.0, 7.5)
    ]
    assert at == [[1, 1, 1, 4], [1, 1, 1, 4], [4, 1, 1, 1], [1, 4, 1, 1], [1, 1, 4, 1]]
    assert moving_factor(straggler, 3, 2.0, start, now_s=start + 8.0) == 4  # round again
    assert moving_factor(straggler, 3, 2.0, time.time()) == 4  # from now: the preset as given


def test_a_drifting_factor_slides_into_the_next_one():
    straggler, start = PRESETS["straggler"], 1000.0
    at = [
        [moving_factor(straggler, rank, 2.0, start, now_s=start + t, drift=True) for rank in range(4)]
        for t in (0.0, 0.5, 1.0, 2.0, 3.5)
    ]
    assert at == [[1, 1, 1, 4], [1.75, 1, 1, 3.25], [2.5, 1, 1, 2.5], [4, 1, 1, 1], [1.75, 3.25, 1, 1]]


def test_a_moving_factor_below_one_is_refused_when_it_comes():
    with pytest.raises(InputError, match="must be finite and >= 1, got nan"):
        Slowdown(lambda: float("nan"), device_s_per_sample=0.001).stretch(0.0, 1)


def test_an_emulated_device_follows_a_moving_factor():
    factor = [3.0]
    slow = Slowdown(lambda: factor[0], device_s_per_sample=0.004)
    start = time.perf_counter()
    slow.stretch(0.0, 2)  # 3 x 2 x 4 ms = 24 ms
    middle = time.perf_counter()
    factor[0] = 1.0
    slow.stretch(0.0, 2)  # the factor now: 1 x 2 x 4 ms = 8 ms
    end = time.perf_counter()
    assert middle - start >= 0.0235 and end - middle < 0.0235
