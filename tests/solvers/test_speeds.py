"""ABS-SGD's adaptive split: when it moves, and the clock a rank's speed is timed by (no MPI)."""

import os
import subprocess
import sys
import time

import pytest

from mpisolve.solvers.speeds import proportional_batches, rank_clock, resplit, round_time


def medians(rounds):
    return tuple(sorted(column)[len(column) // 2] for column in zip(*rounds))


def test_speeds_that_only_scatter_keep_the_split():
    rounds = [[10.0, 12.0, 9.0, 11.0], [12.0, 9.0, 11.0, 10.0], [9.0, 11.0, 12.0, 10.0]]
    assert proportional_batches(medians(rounds), 128) != [32] * 4  # the medians alone would move it
    assert resplit([32] * 4, rounds) == [32] * 4


def test_a_rank_slower_in_every_round_is_moved_off():
    rounds = [[1.0, 1.0, 1.0, 0.25], [1.1, 0.9, 1.0, 0.3], [0.9, 1.0, 1.1, 0.22]]
    split = resplit([32] * 4, rounds)
    assert split == proportional_batches(medians(rounds), 128) and split[3] < 16
    assert all(round_time(split, speeds) < round_time([32] * 4, speeds) for speeds in rounds)


def test_one_slow_round_does_not_move_the_split():
    rounds = [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.2], [1.0, 1.0, 1.0, 1.0]]
    assert resplit([32] * 4, rounds) == [32] * 4


def test_round_time_is_the_slowest_ranks():
    assert round_time([40, 40, 39, 9], [1.0, 1.0, 1.0, 0.25]) == 40.0


def test_a_split_that_gains_less_than_the_margin_stays():
    rounds = [[1.0, 1.0, 1.0, 0.9]] * 3  # the proposed split is shorter by about 7% in each
    proposed = proportional_batches(medians(rounds), 128)
    assert all(round_time(proposed, s) < round_time([32] * 4, s) for s in rounds)
    assert resplit([32] * 4, rounds) == [32] * 4


def test_wall_time_where_ranks_have_cores_of_their_own():
    assert rank_clock(False) is time.perf_counter


BUSY = """
import os, sys
os.sched_setaffinity(0, {{{core}}})
print("busy", flush=True)
while True:
    pass
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_where_ranks_share_cores_a_wait_for_the_core_is_not_counted():
    """Two busy processes on this thread's only core: the wall time about triples, the rank's clock
    keeps its own work (time on the core, not time waiting for it)."""
    if rank_clock(True) is time.perf_counter:
        pytest.skip("the kernel keeps no scheduler statistics")
    before = os.sched_getaffinity(0)
    core = min(before)
    os.sched_setaffinity(0, {core})
    busy = [subprocess.Popen([sys.executable, "-c", BUSY.format(core=core)], stdout=subprocess.PIPE) for _ in range(2)]
    try:
        for process in busy:
            assert process.stdout is not None and process.stdout.readline() == b"busy\n"
        clock = rank_clock(True)
        wall, own, work = time.perf_counter(), clock(), time.thread_time()
        total = 0
        while time.thread_time() - work < 0.3:
            total += sum(range(1000))
        wall, own, work = time.perf_counter() - wall, clock() - own, time.thread_time() - work
    finally:
        for process in busy:
            process.kill()
            process.wait()
        os.sched_setaffinity(0, before)
    assert wall > 2 * work, (wall, work)  # the three took turns on the core
    assert abs(own - work) < 0.3 * work, (own, work, wall)
