"""The node level of the cost model: sums in node-shared memory, then the network between nodes.

mpisolve's node-aware allreduce (:mod:`mpisolve.comm.shm`) of ``n`` bytes over ``nodes``
nodes of ``per_node`` ranks each, with the gradients already in the window:

- **bandwidth path**: the node's ranks each sum their ``n / per_node`` share of every
  rank's slot, so the node's memory moves ``n`` bytes read from every slot plus ``n``
  written: ``(per_node + 1) n`` bytes at the node's memory bandwidth ``node_Bps`` (the
  ranks work in parallel; memory, not arithmetic, bounds them), plus ``sync_s`` for the
  two counter waits; then each local rank allreduces its ``n / per_node`` share with
  its peers on the other nodes (``net.allreduce(nodes, n / per_node)``: every rank's
  link carries a slice), all shares at once;
- **latency path** (``n`` at most ``latency_bytes``): every rank sums all ``per_node``
  slots itself: ``per_node * per_node * n`` bytes read and ``per_node * n`` written,
  plus one counter wait, then the full ``n`` over the network (``net.small_allreduce``).

:func:`fit_node_memory` fits ``node_Bps`` and ``sync_s`` to measured times at one node.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..options import require

if TYPE_CHECKING:
    from .network import Network


@dataclass(frozen=True, kw_only=True)
class NodeMemory:
    """A node's shared memory as the node-aware sum sees it: bandwidth (bytes/s; ``math.inf``:
    bytes cost nothing, only the waits), one counter wait (s)."""

    node_Bps: float
    sync_s: float
    latency_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        require(self.node_Bps > 0, f"node_Bps must be > 0, got {self.node_Bps}")  # NaN fails too
        require(math.isfinite(self.sync_s) and self.sync_s >= 0, f"sync_s must be >= 0, got {self.sync_s}")


def node_sum(mem: NodeMemory, per_node: int, n: float) -> float:
    """Seconds for the node's ranks to sum ``n`` bytes each in the window (0 for one rank per node)."""
    if per_node <= 1:
        return 0.0
    if n <= mem.latency_bytes:
        return mem.sync_s + per_node * (per_node + 1) * n / mem.node_Bps
    return 2 * mem.sync_s + (per_node + 1) * n / mem.node_Bps


def node_allreduce(mem: NodeMemory, net: Network, nodes: int, per_node: int, n: float) -> float:
    """Seconds for mpisolve's node-aware allreduce of ``n`` bytes (the module's formula)."""
    require(nodes >= 1 and per_node >= 1, f"nodes and per_node must be >= 1, got {nodes} and {per_node}")
    net = replace(net, memory=None, per_node=1, intra_beta=None)  # between nodes: the network alone
    if per_node == 1:
        return net.allreduce(nodes, n) if n > mem.latency_bytes else net.small_allreduce(nodes, n)
    if n <= mem.latency_bytes:
        return node_sum(mem, per_node, n) + net.small_allreduce(nodes, n)
    return node_sum(mem, per_node, n) + net.allreduce(nodes, n / per_node)


def fit_node_memory(per_node: Sequence[int], n: float, seconds: Sequence[float]) -> NodeMemory:
    """Least-squares ``node_Bps`` and ``sync_s`` from bandwidth-path times of ``n`` bytes at one node.

    ``seconds[i]`` was measured with ``per_node[i]`` ranks; the model is linear in
    ``(2, (per_node + 1) n)`` against ``(sync_s, 1 / node_Bps)``. Where the best fit would
    need a negative counter wait, the bandwidth is fitted alone with ``sync_s = 0`` (the
    least-squares fit under that bound).
    """
    require(len(per_node) == len(seconds) >= 2, "fit_node_memory needs at least two (ranks, seconds) points")
    rows = [(2.0, (p + 1) * n) for p in per_node]
    # Normal equations of the 2x2 least-squares problem.
    a11 = sum(r[0] * r[0] for r in rows)
    a12 = sum(r[0] * r[1] for r in rows)
    a22 = sum(r[1] * r[1] for r in rows)
    b1 = sum(r[0] * t for r, t in zip(rows, seconds))
    b2 = sum(r[1] * t for r, t in zip(rows, seconds))
    det = a11 * a22 - a12 * a12
    require(det > 0, "fit_node_memory needs measurements at two or more different rank counts")
    sync = (b1 * a22 - b2 * a12) / det
    inverse_bw = (a11 * b2 - a12 * b1) / det
    if sync < 0:
        sync, inverse_bw = 0.0, b2 / a22
    require(inverse_bw > 0, "the measured times do not grow with the ranks: no bandwidth to fit")
    return NodeMemory(node_Bps=1.0 / inverse_bw, sync_s=sync)
