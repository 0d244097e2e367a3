"""Who preconditions which layer, and who inverts which factor.

Gradient workers (KAISA's gradient-worker fraction): ``workers`` of the ``ranks``
precondition each layer. The ranks form ``ranks // workers`` groups (group j: ranks j,
j + m, j + 2m, ... with m groups); each layer belongs to one group, whose members all
precondition it, and each of its two factors is inverted by one member (or by every
member, ``EVERY_RANK``). A rank outside the group gets the preconditioned gradient from
the group's member in its row (ranks m*i .. m*i + m - 1). ``workers == ranks``: one group,
every rank preconditions every layer; ``workers == 1``: each layer's owner inverts both
factors and preconditions it alone, and nothing but gradients travels.

Everything here is deterministic in its inputs, so ranks given the same numbers agree
without talking.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Owner of a factor that every member of its layer's group inverts redundantly.
EVERY_RANK = -1

#: Multiply-adds of one n x n decomposition, in units of n^3: Cholesky plus the inverse from
#: it (n^3 / 3 + 2 n^3 / 3), and a symmetric eigendecomposition with vectors (tridiagonal
#: reduction, divide and conquer and back-transformation, about 4 n^3; textbook counts).
DECOMPOSITION_FLOPS = {"inverse": 1.0, "eigen": 4.0}


def flop_cost(n: int, method: str = "inverse") -> float:
    """Relative cost of decomposing one n x n factor."""
    return DECOMPOSITION_FLOPS[method] * float(n) ** 3


def precondition_flop_cost(g_dim: int, a_dim: int, method: str = "inverse") -> float:
    """Relative cost (same unit as :func:`flop_cost`) of preconditioning a ``g x a`` gradient:
    two matrix products for the inverse method, four for the eigen method."""
    products = 2 if method == "inverse" else 4
    return products * float(g_dim) * a_dim * (g_dim + a_dim)


def worker_groups(ranks: int, workers: int) -> list[list[int]]:
    """The groups of ``workers`` ranks that precondition the same layers (see the module doc)."""
    if workers < 1 or ranks % workers:
        raise ValueError(f"{workers} gradient workers per layer do not divide {ranks} ranks into equal groups")
    count = ranks // workers
    return [list(range(j, ranks, count)) for j in range(count)]


def balanced(costs: Sequence[float], ranks: int, replicated: Sequence[bool] | None = None) -> list[int]:
    """Largest cost first, each to the least loaded rank (lowest rank on ties).

    Greedy longest-processing-time scheduling: its makespan is within 4/3 of the best.
    Factors marked ``replicated`` get ``EVERY_RANK`` and add to no single rank's load.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    return _greedy(costs, list(range(ranks)), [0.0] * ranks, replicated)


def _greedy(
    costs: Sequence[float], members: Sequence[int], loads: list[float], replicated: Sequence[bool] | None
) -> list[int]:
    """Largest first onto the least loaded of ``members`` (``loads`` by rank, updated in place)."""
    owners = [EVERY_RANK] * len(costs)
    for f in sorted(range(len(costs)), key=lambda f: (-costs[f], f)):
        if replicated is not None and replicated[f]:
            continue
        rank = min(members, key=lambda r: (loads[r], r))
        owners[f] = rank
        loads[rank] += costs[f]
    return owners


def round_robin(count: int, ranks: int) -> list[int]:
    """Factor f to rank f mod ranks, in layer order (MPD-KFAC's placement)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    return [f % ranks for f in range(count)]


def assign(
    inversion: Sequence[float],
    precondition: Sequence[float],
    groups: Sequence[Sequence[int]],
    *,
    inverters: Sequence[int],
    replicated: Sequence[bool],
    balance: bool,
) -> tuple[list[int], list[int]]:
    """Each layer's group and each factor's owner (factors ``2l`` and ``2l + 1`` are layer l's A and G).

    ``inversion[f]``, ``precondition[i]``: costs in one unit. Only ``inverters`` may own a
    factor, so only groups with one of them get layers. ``balance``: layers, largest
    (inversions plus preconditioning) first, each to the group where the busiest member
    would end least loaded; then, per group, its factors largest first onto its least
    loaded inverter, every member already carrying the group's preconditioning and
    replicated inversions. Otherwise round-robin: layer l to the l-th eligible group
    (cyclically), and each group's factors to its inverters in turn (MPD-KFAC).
    """
    layers = len(precondition)
    if len(inversion) != 2 * layers or len(replicated) != 2 * layers:
        raise ValueError("two factors (A, G) per layer: inversion and replicated need 2 x layers entries")
    seats = set(inverters)
    eligible = [j for j, g in enumerate(groups) if seats & set(g)]
    if not eligible:
        raise ValueError("no group has a rank that may invert")
    ranks = max(r for g in groups for r in g) + 1
    loads = [0.0] * ranks

    def share(layer: int) -> float:  # what every member of the layer's group carries for the layer
        return precondition[layer] + sum(inversion[f] for f in (2 * layer, 2 * layer + 1) if replicated[f])

    layer_group = [0] * layers
    if balance and len(eligible) > 1:
        total = [precondition[i] + inversion[2 * i] + inversion[2 * i + 1] for i in range(layers)]
        for i in sorted(range(layers), key=lambda i: (-total[i], i)):
            best, best_peak = eligible[0], float("inf")
            for j in eligible:
                peak = max(_with_layer(i, groups[j], loads, share(i), inversion, replicated, seats).values())
                if peak < best_peak:
                    best, best_peak = j, peak
            layer_group[i] = best
            for r, load in _with_layer(i, groups[best], loads, share(i), inversion, replicated, seats).items():
                loads[r] = load
    else:
        for i in range(layers):
            layer_group[i] = eligible[i % len(eligible)]
    loads = [0.0] * ranks
    for i in range(layers):
        for r in groups[layer_group[i]]:
            loads[r] += share(i)
    owners = [EVERY_RANK] * (2 * layers)
    for j in eligible:
        members = [f for f in range(2 * layers) if layer_group[f // 2] == j]
        seated = [r for r in groups[j] if r in seats]
        if balance:
            placed = _greedy([inversion[f] for f in members], seated, loads, [replicated[f] for f in members])
        else:
            spread = iter(round_robin(len(members), len(seated)))
            placed = [EVERY_RANK if replicated[f] else seated[next(spread)] for f in members]
        for f, owner in zip(members, placed):
            owners[f] = owner
    return layer_group, owners


def _with_layer(
    layer: int,
    group: Sequence[int],
    loads: Sequence[float],
    shared: float,
    inversion: Sequence[float],
    replicated: Sequence[bool],
    seats: set[int],
) -> dict[int, float]:
    """The group's members' loads with ``layer`` added: ``shared`` on every member, each
    factor not replicated on its least loaded seated member."""
    trial = {r: loads[r] + shared for r in group}
    for f in (2 * layer, 2 * layer + 1):
        if not replicated[f]:
            seat = min((r for r in group if r in seats), key=lambda r: (trial[r], r))
            trial[seat] += inversion[f]
    return trial


def loads(
    costs: Sequence[float],
    owners: Sequence[int],
    ranks: int,
    *,
    precondition: Sequence[float] | None = None,
    layer_group: Sequence[int] | None = None,
    groups: Sequence[Sequence[int]] | None = None,
) -> list[float]:
    """Each rank's cost: the factors it owns, plus, per layer of its group, the layer's
    replicated inversions and its preconditioning. Without groups: one group of every rank
    and no preconditioning cost (inversions only)."""
    if groups is None or layer_group is None:
        groups, layer_group = [list(range(ranks))], [0] * (len(costs) // 2 + len(costs) % 2)
    per_rank = [0.0] * ranks
    for f, (c, o) in enumerate(zip(costs, owners)):
        for r in [o] if o != EVERY_RANK else groups[layer_group[f // 2]]:
            per_rank[r] += c
    if precondition is not None:
        for i, c in enumerate(precondition):
            for r in groups[layer_group[i]]:
                per_rank[r] += c
    return per_rank


def max_over_mean(values: Sequence[float]) -> float:
    """Imbalance of a load vector: 1.0 is perfect."""
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0
