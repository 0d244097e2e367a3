"""LB-BSP's batch split and speed parsing (no MPI)."""

import heapq
import itertools
import random

import pytest

from mpisolve.errors import OptionError
from mpisolve.solvers.speeds import parse_speeds, proportional_batches


def test_batches_follow_speed_and_sum_to_the_total():
    assert proportional_batches((1.0, 1.0, 1.0, 0.25), 128) == [40, 40, 39, 9]
    assert proportional_batches((3.0, 1.0), 8) == [6, 2]
    assert proportional_batches((1.0, 1e-9), 2) == [1, 1]  # everyone gets a sample


@pytest.mark.parametrize(
    "speeds, total, split",
    [
        ((1.0, 1.0, 1.0, 0.25), 16, [5, 5, 5, 1]),  # a straggler: 5 time units, where 5, 5, 4, 2 took 8
        ((1.0, 1 / 1.5, 0.5, 1 / 3), 16, [7, 4, 3, 2]),  # graded: 7 units, where 6, 4, 3, 3 took 9
        ((1.0, 1.0, 0.5, 0.5), 16, [6, 6, 2, 2]),  # two tiers: 6 units
    ],
)
def test_the_split_minimises_the_slowest_ranks_step(speeds, total, split):
    assert proportional_batches(speeds, total) == split
    step = max(b / s for b, s in zip(split, speeds))
    # no split of the total, one sample or more each, is faster (every one of the 455 is tried)
    others = [
        (a, b, c, total - a - b - c) for a, b, c in itertools.product(range(1, total), repeat=3) if a + b + c < total
    ]
    assert len(others) == 455
    assert min(max(b / s for b, s in zip(other, speeds)) for other in others) >= step - 1e-12


def one_sample_at_a_time(speeds, total):
    """The split's definition: one sample each, then every further one to the rank that would finish it soonest."""
    batches = [1] * len(speeds)
    finish = [(2 / speed, rank) for rank, speed in enumerate(speeds)]
    heapq.heapify(finish)
    for _ in range(total - len(speeds)):
        _, rank = heapq.heappop(finish)
        batches[rank] += 1
        heapq.heappush(finish, ((batches[rank] + 1) / speeds[rank], rank))
    return batches


def test_the_split_starting_from_shares_is_the_one_sample_at_a_time_split():
    rng = random.Random(0)
    for _ in range(500):
        ranks = rng.randint(1, 64)
        speeds = tuple(rng.choice([1.0, 0.5, 0.25, rng.uniform(1e-3, 10.0)]) for _ in range(ranks))
        total = rng.randint(ranks, ranks * 200)
        assert proportional_batches(speeds, total) == one_sample_at_a_time(speeds, total), (speeds, total)


def test_bad_speeds_are_named():
    assert parse_speeds("1, 2.5") == (1.0, 2.5)
    with pytest.raises(OptionError, match="'measure' or comma-separated numbers"):
        parse_speeds("fast,slow")
    with pytest.raises(OptionError, match="every speed must be finite and > 0, got '0'"):
        parse_speeds("1,0")
    with pytest.raises(OptionError, match="cannot give each of 3 ranks"):
        proportional_batches((1.0, 1.0, 1.0), 2)
    with pytest.raises(OptionError, match="every speed must be finite and > 0"):
        proportional_batches((1.0, 0.0), 4)
