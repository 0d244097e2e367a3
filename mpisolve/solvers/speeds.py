"""Batch splitting by speed: each rank's share of a global batch, from measured or given speeds.

Shared by the solvers that size each rank's micro-batch by its speed (``lb-bsp`` once,
``abs-sgd`` as the speeds change), so that all ranks finish a step together.
"""

from __future__ import annotations

import heapq
import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence

from ..comm.communicator import Communicator
from ..errors import OptionError
from ..options import require


def parse_speeds(text: str) -> tuple[float, ...]:
    """``"1,1,1,0.25"`` -> relative speeds (finite, > 0)."""
    speeds = []
    for item in text.split(","):
        try:
            speed = float(item)
        except ValueError:
            raise OptionError(f"speeds must be 'measure' or comma-separated numbers, got {text!r}") from None
        require(math.isfinite(speed) and speed > 0, f"every speed must be finite and > 0, got {item.strip()!r}")
        speeds.append(speed)
    return tuple(speeds)


def proportional_batches(speeds: tuple[float, ...], total: int) -> list[int]:
    """``total`` samples split by ``speeds`` so that the slowest rank's step is as short as it can be.

    Every rank gets one sample, then each further sample goes to the rank that would
    finish it soonest. This minimises the step's time,
    ``max(batch / speed)``; rounding shares of the spare samples does not (with speeds
    1, 1, 1, 0.25 and 16 samples it gives 5, 5, 4, 2: a step of 2 / 0.25 = 8 units, not 5).
    The greedy part starts from one sample under each rank's share of the spare ones,
    which it would have given anyway, so it places about one sample per rank, not the
    whole batch (ABS-SGD splits again every round).
    """
    if total < len(speeds):
        raise OptionError(f"a global batch of {total} cannot give each of {len(speeds)} ranks a sample")
    require(all(math.isfinite(s) and s > 0 for s in speeds), f"every speed must be finite and > 0, got {speeds}")
    # The last spare sample ends at time >= spare / sum(speeds): every k / speed below that is taken.
    per_speed = (total - len(speeds)) / sum(speeds)
    batches = [max(1, math.floor(per_speed * speed) - 1) for speed in speeds]
    finish = [((batch + 1) / speed, rank) for rank, (batch, speed) in enumerate(zip(batches, speeds))]
    heapq.heapify(finish)  # when each rank's next sample would end
    for _ in range(total - sum(batches)):
        _, rank = heapq.heappop(finish)
        batches[rank] += 1
        heapq.heappush(finish, ((batches[rank] + 1) / speeds[rank], rank))
    return batches


def round_time(batches: Sequence[int], speeds: Sequence[float]) -> float:
    """How long a step of ``batches`` takes at ``speeds``: its slowest rank's time."""
    return max(batch / speed for batch, speed in zip(batches, speeds))


def resplit(current: list[int], rounds: Sequence[Sequence[float]]) -> list[int]:
    """The split by the median of each rank's speeds over ``rounds``, where it would have made each of them
    at least :data:`RESPLIT_GAIN` shorter; else ``current``.

    On shared cores a rank's speed moves by tens of percent from one round to the next, and a
    split that chases those moves (each a new micro-batch shape) gains nothing; a rank that is
    slower in every round is moved off in as many rounds as ``rounds`` holds; one only slightly
    slower (at 4 ranks, under about 13% in speed; at 2, 18%) is left as it is.
    """
    medians = tuple(statistics.median(rank_speeds) for rank_speeds in zip(*rounds))
    proposed = proportional_batches(medians, sum(current))
    if all(round_time(proposed, speeds) < (1 - RESPLIT_GAIN) * round_time(current, speeds) for speeds in rounds):
        return proposed
    return current


#: How much shorter a new split must have made each round it is judged on.
RESPLIT_GAIN = 0.1

#: The calling thread's scheduler statistics: time on a core, time waiting for one (ns), timeslices.
SCHEDSTAT = "/proc/thread-self/schedstat"


def rank_clock(shares_cores_evenly: bool) -> Callable[[], float]:
    """The clock a rank's speed is timed by: wall time, less its waits for a core where ranks share them evenly.

    Where a machine runs more ranks than the cores they may use, none bound to some of them
    (``shares_cores_evenly``), the kernel gives each an even share over time, and a rank's wall
    time depends on the others' micro-batches: the rank given the most samples ends its
    micro-batch alone on a core, looks fastest and is given more still, so a split by wall-time
    speeds runs away from the even one. There the time the kernel kept the calling thread
    waiting for a core (Linux's ``schedstat``) is left out; its own work and its sleeps count. A
    micro-batch is timed on one thread (its forward and its step). Elsewhere (ranks with cores of
    their own, or bound to some, where a wait for a core is a real difference in speed), and
    where the kernel does not say, the wall time.
    """
    if not shares_cores_evenly or _core_waits_ns() is None:
        return time.perf_counter
    return _wall_less_core_waits


_last_waits = threading.local()


def _core_waits_ns() -> int | None:
    """The calling thread's time waiting for a core so far (ns), or None where the kernel does not say."""
    try:
        with open(SCHEDSTAT, "rb") as stats:  # read anew: the thread that asks is the one measured
            on_core, waiting = (int(field) for field in stats.read().split()[:2])
    except (OSError, ValueError):
        return None
    return waiting if on_core > 0 else None  # all zeros: the kernel keeps no scheduler statistics


def _wall_less_core_waits() -> float:
    waited = _core_waits_ns()
    if waited is None:  # could not be read this time: the last reading (wall time from there on)
        waited = getattr(_last_waits, "ns", 0)
    _last_waits.ns = waited
    return time.perf_counter() - waited * 1e-9


def measure_speeds(
    comm: Communicator, configured: int, probe: Callable[[int], float] | None, batches: int, *, who: str
) -> tuple[float, ...]:
    """Collective: every rank's speed in samples/s, from ``probe`` (a warm-up, then the median of ``batches``)."""
    if probe is None:
        raise OptionError(f"{who} measures each rank's speed with the training loop's probe, and none was given")
    probe(configured)
    seconds = statistics.median(probe(configured) for _ in range(batches))
    return tuple(comm.allgather_object(configured / max(seconds, 1e-9)))
