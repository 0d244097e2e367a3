"""Emulated heterogeneous clusters: each rank computes as if on a slower device.

A rank with factor ``f`` measures the compute of each micro-batch (forward, loss,
backward, minus any time it spent blocked in MPI) and then sleeps ``(f - 1)`` times that
long, so its compute takes ``f`` times its own measured time, as on a device ``f`` times
slower. Sleeping, rather than computing more, leaves the CPU to the other ranks, which
matters when ranks share cores.

With an emulated device (``--device-ms``) a micro-batch of ``n`` samples takes exactly
``f * n * ms`` milliseconds instead: the real compute, then a sleep for the rest. When
more ranks than cores share a node, their real compute contends for the cores and a
rank's measured time depends on what the others do; a device time that covers the
contended compute takes that out, so every rank behaves as if it had a device of its own
(a GPU, say) of the stated speed. A micro-batch whose real compute overran its device
time is counted (``overruns``): the emulation was not faithful for it.

Presets describe heterogeneous 4-worker clusters; at other world sizes the pattern
repeats (rank r gets the preset's factor ``r mod 4``). A cluster can also move
(``--hetero-every S``): every S seconds each factor passes to the next rank, as when
another job's load moves from node to node, so speeds measured once go stale.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from ..errors import InputError

#: Named heterogeneous 4-worker clusters (slowdown factor of each worker).
PRESETS: dict[str, tuple[float, ...]] = {
    # One worker 4x slower than the rest: a straggler (an older GPU, a busy node).
    "straggler": (1.0, 1.0, 1.0, 4.0),
    # Two generations of devices: half the cluster at half speed.
    "two-tier": (1.0, 1.0, 2.0, 2.0),
    # Every worker different, from full speed to a third of it.
    "graded": (1.0, 1.5, 2.0, 3.0),
}


def parse_hetero(spec: str | list[float] | tuple[float, ...]) -> tuple[str | None, tuple[float, ...]]:
    """A preset name or a list of factors (``"1,1,2,4"``) -> (preset name or None, factors)."""
    if isinstance(spec, str) and spec in PRESETS:
        return spec, PRESETS[spec]
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    factors = []
    for item in items:
        try:
            factor = float(item)
        except (TypeError, ValueError):
            raise InputError(
                f"--hetero {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a comma-separated list of factors"
            ) from None
        if not (math.isfinite(factor) and factor >= 1):
            raise InputError(f"--hetero factors must be finite and >= 1 (a slowdown), got {item!r}")
        factors.append(factor)
    if not factors:
        raise InputError("--hetero needs at least one factor")
    return None, tuple(factors)


def factors_for_world(preset: str | None, factors: tuple[float, ...], size: int) -> tuple[float, ...]:
    """Every rank's factor: a preset repeats over the ranks, an explicit list must name each rank."""
    if preset is not None:
        return tuple(factors[r % len(factors)] for r in range(size))
    if len(factors) != size:
        raise InputError(f"--hetero gives {len(factors)} factors for {size} ranks (give one per rank, or a preset)")
    return factors


def moving_factor(
    factors: tuple[float, ...],
    rank: int,
    every_s: float,
    start_s: float,
    now_s: float | None = None,
    *,
    drift: bool = False,
) -> float:
    """``rank``'s factor at ``now_s`` (default: now, by the wall clock) when the cluster's
    ``factors`` move one rank along every ``every_s`` seconds from ``start_s`` (a time every
    rank agreed on: rank 0's clock when the run began). With ``drift`` a factor slides
    linearly into the next one over the period instead of jumping at its end."""
    phase = ((time.time() if now_s is None else now_s) - start_s) / every_s
    period = math.floor(phase)
    now = factors[(rank - period) % len(factors)]
    if not drift:
        return now
    upcoming = factors[(rank - period - 1) % len(factors)]
    return now + (phase - period) * (upcoming - now)


class Slowdown:
    """Stretches this rank's compute to ``factor`` times its measured duration, or to
    ``factor`` times an emulated device's time per sample when one is set. ``factor`` is a
    number, or a function giving the factor now (a moving cluster, :func:`moving_factor`)."""

    def __init__(self, factor: float | Callable[[], float], device_s_per_sample: float | None = None) -> None:
        if not callable(factor) and not (math.isfinite(factor) and factor >= 1):
            raise InputError(f"a slowdown factor must be finite and >= 1, got {factor}")
        if device_s_per_sample is not None and not (math.isfinite(device_s_per_sample) and device_s_per_sample > 0):
            raise InputError(f"an emulated device's time per sample must be > 0, got {device_s_per_sample}")
        self.factor = factor
        self.device_s_per_sample = device_s_per_sample
        #: Micro-batches whose real compute took longer than the emulated device's time.
        self.overruns = 0
        #: Micro-batches stretched.
        self.batches = 0

    def stretch(self, compute_s: float, samples: int) -> None:
        """Sleep so that ``compute_s`` seconds of compute on ``samples`` samples take their emulated time."""
        self.batches += 1
        factor = self.factor() if callable(self.factor) else self.factor
        if not factor >= 1:  # a moving factor is checked as it comes (NaN fails too)
            raise InputError(f"a slowdown factor must be finite and >= 1, got {factor}")
        if self.device_s_per_sample is None:
            extra = (factor - 1.0) * compute_s
        else:
            extra = factor * self.device_s_per_sample * samples - compute_s
            if extra < 0:
                self.overruns += 1
        if extra > 0:
            time.sleep(extra)
