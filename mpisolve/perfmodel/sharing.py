"""Ranks sharing a machine's cores: what an alpha-beta model leaves out on an oversubscribed node.

With ``cores`` cores free for the job (the machine's, less what other processes keep
busy: measured while the job runs) and ``p`` ranks, ``k = p / cores`` ranks share each
core.

- **compute**: a rank's step takes ``max(k, 1)`` times its step alone (beyond one rank a
  core, the core is time-shared), times ``1 + memory b + contention min(k - 1, 1) +
  crowding max(k - 2, 0)`` (each term 0 below its range): ranks on the other cores share
  the machine's last-level cache and memory bandwidth (``memory``, reached as the ranks
  fill the cores: ``b``, the share of the other cores busy, 1 from ``p >= cores``);
  sharing a core costs caches and switches (``contention``, reached at two ranks a core),
  and each further rank a core may cost more (``crowding``: their working sets crowd the
  shared cache) or nothing (a workload whose data never stayed in cache).

Beyond one rank a core (k > 1):

- **a blocking exchange** (a collective every rank waits for) costs ``wait_s (k - 1)``
  more: ranks that left it compute while the late ones wait for a core to finish theirs;
- **a lock acquisition** (a locked window's shard) costs ``lock_s (k - 1)``: its holder
  may be off its core.

``memory``, ``contention`` and ``crowding`` are the workload's (they depend on its caches); ``wait_s``
and ``lock_s`` the machine's. :func:`.calibrate.fit_contention` fits the first three to
a workload's steps with several ranks computing at once, :func:`.calibrate.fit_through_origin`
the others to what a synthetic workload's runs leave over (perf/model_calibration.py,
perf/scaling_model.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..options import require


@dataclass(frozen=True, kw_only=True)
class SharedCores:
    """``cores`` free for the job (may be fractional), the workload's ``memory``, ``contention``
    and ``crowding``, and the machine's ``wait_s`` per blocking exchange and ``lock_s`` per lock
    acquisition, each per extra rank a core."""

    cores: float
    memory: float = 0.0
    contention: float = 0.0
    crowding: float = 0.0
    wait_s: float = 0.0
    lock_s: float = 0.0

    def __post_init__(self) -> None:
        require(math.isfinite(self.cores) and self.cores > 0, f"cores must be > 0, got {self.cores}")
        for key in ("memory", "contention", "crowding", "wait_s", "lock_s"):
            value = getattr(self, key)
            require(math.isfinite(value) and value >= 0, f"{key} must be >= 0, got {value}")

    def extra(self, p: int) -> float:
        """Ranks a core beyond the first: ``max(0, p / cores - 1)``."""
        return max(0.0, p / self.cores - 1.0)

    def busy(self, p: int) -> float:
        """The share of the other cores that ``p`` ranks keep busy: ``min(1, (p - 1) / (cores - 1))``."""
        if p <= 1:
            return 0.0
        return 1.0 if self.cores <= 1 else min(1.0, (p - 1) / (self.cores - 1))

    def slowdown(self, p: int) -> float:
        """How much longer a rank's step takes at ``p`` ranks than alone."""
        extra = self.extra(p)
        shared = self.memory * self.busy(p) + self.contention * min(extra, 1.0) + self.crowding * max(extra - 1.0, 0.0)
        return (1.0 + extra) * (1.0 + shared)

    def waits(self, p: int, exchanges: float) -> float:
        """Seconds ``exchanges`` blocking exchanges add at ``p`` ranks."""
        return exchanges * self.wait_s * self.extra(p)

    def locks(self, p: int, acquisitions: float) -> float:
        """Seconds ``acquisitions`` lock acquisitions add at ``p`` ranks."""
        return acquisitions * self.lock_s * self.extra(p)
