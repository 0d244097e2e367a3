"""Emulated heterogeneous clusters: each rank computes as if on a slower device.

A rank with factor ``f`` measures the compute of each micro-batch (forward, loss,
backward, minus any time it spent blocked in MPI) and then sleeps ``(f - 1)`` times that
long, so its compute takes ``f`` times its own measured time, as on a device ``f`` times
slower. Sleeping, rather than computing more, leaves the CPU to the other ranks, which
matters when ranks share cores.

Presets describe heterogeneous 4-worker clusters; at other world sizes the pattern
repeats (rank r gets the preset's factor ``r mod 4``).
"""

from __future__ import annotations

import math
import time

from ..options import InputError

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


class Slowdown:
    """Stretches this rank's compute to ``factor`` times its measured duration."""

    def __init__(self, factor: float) -> None:
        if not (math.isfinite(factor) and factor >= 1):
            raise InputError(f"a slowdown factor must be finite and >= 1, got {factor}")
        self.factor = factor

    def stretch(self, compute_s: float) -> None:
        """Sleep so that ``compute_s`` seconds of compute take ``factor * compute_s`` in all."""
        extra = (self.factor - 1.0) * compute_s
        if extra > 0:
            time.sleep(extra)
