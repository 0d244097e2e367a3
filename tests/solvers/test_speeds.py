"""ABS-SGD's adaptive split: when it moves, and the clock a rank's speed is timed by (no MPI)."""

import os
import subprocess
import sys
import time

import pytest

from mpisolve.solvers.speeds import SCHEDSTAT, proportional_batches, rank_clock, resplit, round_time


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


def test_wall_time_where_ranks_have_cores_of_their_own():
    assert rank_clock(False) is time.perf_counter


@pytest.mark.skipif(not os.path.exists(SCHEDSTAT) or not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_where_ranks_share_cores_a_wait_for_the_core_is_not_counted():
    """A busy process on this thread's only core: the wall time doubles, the rank's clock keeps its work."""
    before = os.sched_getaffinity(0)
    core = min(before)
    os.sched_setaffinity(0, {core})
    hog = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    try:
        time.sleep(0.2)  # the busy process is running
        clock = rank_clock(True)
        wall, own, work = time.perf_counter(), clock(), time.thread_time()
        total = 0
        while time.thread_time() - work < 0.3:
            total += sum(range(1000))
        wall, own, work = time.perf_counter() - wall, clock() - own, time.thread_time() - work
    finally:
        hog.kill()
        hog.wait()
        os.sched_setaffinity(0, before)
    assert wall > 1.5 * work, (wall, work)  # the two took turns on the core
    assert 0.9 * work < own < 0.5 * (work + wall), (own, work, wall)
