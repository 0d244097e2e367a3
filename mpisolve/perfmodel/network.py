"""Alpha-beta-gamma costs of the collectives the solvers use.

A message of ``n`` bytes between two ranks costs ``alpha + n * beta`` seconds; reducing
``n`` bytes locally costs ``n * gamma``. With ``p`` ranks (``k`` the largest power of two
<= p, ``log`` base 2):

Large allreduces use ``algorithm``: ring, halving-doubling, or ``auto`` (the cheaper).
A network of nodes of ``per_node`` ranks each (GPUs sharing a node's link): among the
ranks of one node, a byte costs ``intra_beta`` (NVLink, PCIe); across nodes, ``beta``
(the node's link). With ``memory`` (:class:`.node.NodeMemory`), an allreduce is
mpisolve's node-aware one (:func:`.node.node_allreduce`: sums in the node's shared
memory, priced by its bandwidth, then the network between nodes). Otherwise, across
nodes, every bandwidth-optimal allreduce passes about 2n bytes through each node's link
whatever the ranks per node (ring: the ring enters and leaves each node once;
halving-doubling: the node's ranks send their shares through it at once), so the formulas
below keep ``beta``: the node level changes only a one-node job.

- ring allreduce: ``2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma``;
- halving-doubling allreduce (Rabenseifner: reduce-scatter by recursive halving, then
  allgather by recursive doubling): ``2 log k alpha + 2(k-1)/k n beta + (k-1)/k n gamma``,
  plus, when ``p`` is not a power of two, the fold of the extra ranks in and out
  (``2 (alpha + n beta) + n gamma``), as MPICH does;
- recursive doubling (small messages): ``ceil(log p) (alpha + n beta + n gamma)``;
- broadcast (scatter + ring allgather, van de Geijn): ``(log p + p - 1) alpha + 2(p-1)/p n beta``;
- allgather of ``n`` bytes in total (ring): ``(p-1) alpha + (p-1)/p n beta``;
- window exchange (a get and an accumulate of the whole shared vector of ``n`` bytes):
  sharded, ``2(p-1)`` messages to the other ranks' shards and ``2(p-1)/p n`` bytes, or
  from rank 0 alone (``server``: 2 messages, 2n bytes, rank 0's link carrying every
  worker's 2n); a locked exchange adds a lock and an unlock per shard; plus the update
  of the remote part, ``(p-1)/p n gamma``.

Each function returns seconds, 0 for one rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from ..options import require
from .node import NodeMemory, node_allreduce

Algorithm = Literal["ring", "halving-doubling", "auto"]
#: "auto": the cheaper of the two for each message, as a tuned library would choose.
ALGORITHMS: tuple[str, ...] = ("ring", "halving-doubling", "auto")


@dataclass(frozen=True, kw_only=True)
class Network:
    """Per-message latency ``alpha`` (s), per-byte time ``beta`` (s/B), per-byte reduction
    time ``gamma`` (s/B), and the allreduce algorithm for large messages; ``per_node``
    ranks share a node, among which a byte costs ``intra_beta`` (None: ``beta``), or which
    sum in its shared memory (``memory``)."""

    alpha: float
    beta: float
    gamma: float = 0.0
    algorithm: Algorithm = "ring"
    name: str = "custom"
    per_node: int = 1
    intra_beta: float | None = None
    memory: NodeMemory | None = None

    def __post_init__(self) -> None:
        for key in ("alpha", "beta", "gamma"):
            value = getattr(self, key)
            require(math.isfinite(value) and value >= 0, f"{key} must be >= 0, got {value}")
        require(
            self.algorithm in ALGORITHMS, f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}"
        )
        require(self.per_node >= 1, f"per_node must be >= 1, got {self.per_node}")
        require(
            self.intra_beta is None or (math.isfinite(self.intra_beta) and self.intra_beta >= 0),
            f"intra_beta must be >= 0, got {self.intra_beta}",
        )

    def at(self, p: int) -> Network:
        """The network ``p`` ranks use: the node's links when they fit in one node."""
        if p <= self.per_node and self.intra_beta is not None:
            return replace(self, beta=self.intra_beta, per_node=1, intra_beta=None, memory=None)
        return self

    @classmethod
    def from_link(cls, *, gbit_s: float, latency_us: float, **kwargs: object) -> Network:
        """A network from its link speed (Gb/s, 10^9 bits) and one-way latency (microseconds)."""
        require(gbit_s > 0, f"bandwidth must be > 0 Gb/s, got {gbit_s}")
        return cls(alpha=latency_us * 1e-6, beta=8 / (gbit_s * 1e9), **kwargs)  # type: ignore[arg-type]

    # ------------------------------------------------------------- collectives
    def allreduce(self, p: int, n: float) -> float:
        """Allreduce of ``n`` bytes with this network's large-message algorithm (or the node-aware one)."""
        if self.memory is not None:
            return self._node_aware(p, n)
        net = self.at(p)
        if self.algorithm == "ring":
            return ring_allreduce(net, p, n)
        if self.algorithm == "halving-doubling":
            return halving_doubling_allreduce(net, p, n)
        return min(ring_allreduce(net, p, n), halving_doubling_allreduce(net, p, n))

    def small_allreduce(self, p: int, n: float) -> float:
        if self.memory is not None:
            return self._node_aware(p, n)
        return recursive_doubling_allreduce(self.at(p), p, n)

    def _node_aware(self, p: int, n: float) -> float:
        assert self.memory is not None
        nodes = math.ceil(p / self.per_node)
        return node_allreduce(self.memory, self, nodes, min(p, self.per_node), n)


def ring_allreduce(net: Network, p: int, n: float) -> float:
    if p <= 1:
        return 0.0
    return 2 * (p - 1) * net.alpha + 2 * (p - 1) / p * n * net.beta + (p - 1) / p * n * net.gamma


def halving_doubling_allreduce(net: Network, p: int, n: float) -> float:
    if p <= 1:
        return 0.0
    k = 1 << (p.bit_length() - 1)
    fold = 0.0 if k == p else 2 * (net.alpha + n * net.beta) + n * net.gamma
    if k == 1:
        return fold
    return fold + 2 * math.log2(k) * net.alpha + 2 * (k - 1) / k * n * net.beta + (k - 1) / k * n * net.gamma


def recursive_doubling_allreduce(net: Network, p: int, n: float) -> float:
    if p <= 1:
        return 0.0
    return math.ceil(math.log2(p)) * (net.alpha + n * (net.beta + net.gamma))


def broadcast(net: Network, p: int, n: float) -> float:
    if p <= 1:
        return 0.0
    net = net.at(p)
    return (math.log2(p) + p - 1) * net.alpha + 2 * (p - 1) / p * n * net.beta


def allgather(net: Network, p: int, n_total: float) -> float:
    if p <= 1:
        return 0.0
    net = net.at(p)
    return (p - 1) * net.alpha + (p - 1) / p * n_total * net.beta


def adasum_levels(p: int) -> int:
    """The pairwise exchanges one rank's Adasum passes at ``p`` ranks: ``log k`` levels,
    and the fold of the extra ranks where ``p`` is not a power of two."""
    if p <= 1:
        return 0
    k = 1 << (p.bit_length() - 1)
    return k.bit_length() - 1 + (0 if k == p else 1)


def adasum_allreduce(net: Network, p: int, n: float, *, tensors: int, gamma_adasum: float) -> float:
    """mpisolve's Adasum (VHDD): the data volume of halving-doubling, plus at each of the
    ``log k`` levels a small allreduce of ``tensors`` x 3 float64 statistics over the 2L
    ranks of the block, and ``gamma_adasum`` per byte for the statistics and the combine."""
    if p <= 1:
        return 0.0
    net = net.at(p)
    k = 1 << (p.bit_length() - 1)
    data = halving_doubling_allreduce(Network(alpha=net.alpha, beta=net.beta), p, n)
    stats = sum(recursive_doubling_allreduce(net, 2 << level, 24 * tensors) for level in range(int(math.log2(k))))
    combine = ((k - 1) / k + (0 if k == p else 1)) * n * gamma_adasum
    return data + stats + combine


def window_exchange(net: Network, p: int, n: float, *, locked: bool, layout: str = "sharded") -> float:
    """One worker's exchange with a shared vector of ``n`` bytes (the module's formula)."""
    if p <= 1:
        return 0.0
    net = net.at(p)
    if layout == "server":
        messages, own = 2, 2 * n
        link = 2 * n * (p - 1) * net.beta  # rank 0's link carries every worker's get and accumulate
    else:
        messages, own = 2 * (p - 1), 2 * n * (p - 1) / p
        link = own * net.beta
    if locked:
        messages *= 2  # lock and unlock around each shard's get and accumulate
    return max(messages * net.alpha + own * net.beta, link) + n * (p - 1) / p * net.gamma
