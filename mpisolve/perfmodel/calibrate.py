"""Alpha and beta (and Adasum's gamma) from an allreduce sweep (``bench sweep --csv``),
and the window exchange's own alpha and beta from ``bench windows --csv``.

The sweep's rows give the latency of one allreduce of ``bytes`` at ``ranks``. For a
chosen algorithm the model is linear in its parameters, ``t = alpha A(p) + beta B(p, n)``
(:mod:`.network`), so a least-squares fit over every size and rank count recovers them.
Rows are weighted by 1/t, so that the 4-byte and the 64-MiB rows count alike (the fit
minimises relative error). gamma cannot be told apart from beta in an allreduce (both
scale with (p-1)/p n) and is left in beta; Adasum's extra per-byte work is fitted from
the ``adasum`` rows as ``gamma_adasum`` on top of the fitted network.

Window exchanges (one-sided gets, accumulates and locks) cost something else than an
allreduce's messages: :func:`fit_window` fits :func:`.network.window_exchange`'s alpha
and beta, per mode (locked, wild), to the measured exchanges of ``bench windows``.

:func:`fit_node_sum` fits a node's memory bandwidth and counter wait to one rank count's
node-shared sums (:mod:`.node`), all ranks on one node.

Ranks sharing cores (:mod:`.sharing`): :func:`fit_contention` fits a workload's compute
contention and crowding to its steps with several ranks computing at once, and
:func:`fit_through_origin` the per-extra-rank costs of waits and locks to what runs on a
synthetic workload left over, and :func:`fit_scale_and_latency` how much dearer a training
step pays an exchange than a benchmark (perf/scaling_model.py does that part).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from ..errors import InputError
from .network import Algorithm, Network, adasum_allreduce, window_exchange
from .node import NodeMemory, node_sum
from .sharing import SharedCores

#: Columns a sweep CSV must have, each with how its text is read.
SWEEP_COLUMNS: dict[str, Callable[[str], float | str]] = {"ranks": int, "op": str, "bytes": float, "latency_us": float}
#: The fewest cores a job is counted to have, however busy other processes kept the machine.
MIN_FREE_CORES = 0.5
#: Columns a ``bench windows`` CSV must have, each with how its text is read.
WINDOW_COLUMNS: dict[str, Callable[[str], float | str]] = {
    "ranks": int,
    "path": str,
    "mode": str,
    "layout": str,
    "bytes": float,
    "seconds": float,
}


def _read_csv(
    paths: Iterable[Path | str], columns: Mapping[str, Callable[[str], float | str]], kind: str
) -> list[dict[str, float | str]]:
    """``columns`` of every row of ``kind`` CSVs at ``paths``, each read as given; a bad file is an InputError."""
    rows: list[dict[str, float | str]] = []
    for path in paths:
        try:
            with open(path, newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                missing = [c for c in columns if c not in (reader.fieldnames or ())]
                if missing:
                    raise InputError(f"{path}: not a {kind} CSV (missing columns: {', '.join(missing)})")
                rows.extend({name: read(row[name]) for name, read in columns.items()} for row in reader)
        except OSError as err:
            raise InputError(f"cannot read {kind} CSV {path}: {err.strerror}") from None
        except ValueError as err:
            raise InputError(f"{path}: bad value in a {kind} row ({err})") from None
    return rows


def read_sweep(paths: Iterable[Path | str]) -> list[dict[str, float | str]]:
    """The rows of sweep CSVs: ``ranks``, ``op``, ``bytes``, ``seconds``."""
    rows = _read_csv(paths, SWEEP_COLUMNS, "sweep")
    for row in rows:
        row["seconds"] = float(row.pop("latency_us")) * 1e-6
    return rows


def read_window_bench(paths: Iterable[Path | str]) -> list[dict[str, float | str]]:
    """The rows of ``bench windows`` CSVs: ``ranks``, ``path``, ``mode``, ``layout``, ``bytes``, ``seconds``."""
    return _read_csv(paths, WINDOW_COLUMNS, "bench windows")


def _nonnegative_lstsq(columns: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (two or three unknowns: try each active set)."""
    best, best_err = np.zeros(columns.shape[1]), math.inf
    count = columns.shape[1]
    for mask in range(1, 1 << count):
        keep = [i for i in range(count) if mask >> i & 1]
        coef, *_ = np.linalg.lstsq(columns[:, keep], target, rcond=None)
        if np.any(coef < 0):
            continue
        full = np.zeros(count)
        full[keep] = coef
        err = float(np.sum((columns @ full - target) ** 2))
        if err < best_err:
            best, best_err = full, err
    return best


def fit_network(
    rows: Sequence[Mapping[str, float | str]],
    *,
    op: str = "mpi",
    algorithm: Algorithm = "ring",
    name: str = "calibrated",
) -> Network:
    """alpha and beta of ``algorithm`` fitted to the ``op`` rows at 2 ranks or more."""
    if algorithm == "auto":
        raise InputError("calibration fits one algorithm's formula: ring or halving-doubling, not auto")
    mine = [r for r in rows if r["op"] == op and int(r["ranks"]) >= 2]
    if len({(int(r["ranks"]), float(r["bytes"])) for r in mine}) < 2:
        raise InputError(
            f"the sweep has too few '{op}' rows to fit alpha and beta (ops present: "
            f"{', '.join(sorted({str(r['op']) for r in rows})) or 'none'})"
        )
    unit_alpha, unit_beta = (
        Network(alpha=1.0, beta=0.0, algorithm=algorithm),
        Network(alpha=0.0, beta=1.0, algorithm=algorithm),
    )
    design = np.array(
        [
            [
                unit_alpha.allreduce(int(r["ranks"]), float(r["bytes"])),
                unit_beta.allreduce(int(r["ranks"]), float(r["bytes"])),
            ]
            for r in mine
        ]
    )
    seconds = np.array([float(r["seconds"]) for r in mine])
    weights = 1 / seconds
    alpha, beta = _nonnegative_lstsq(design * weights[:, None], seconds * weights)
    return Network(alpha=float(alpha), beta=float(beta), algorithm=algorithm, name=name)


def fit_adasum_gamma(rows: Sequence[Mapping[str, float | str]], net: Network) -> float:
    """Adasum's per-byte statistics and combine time over ``net``, from the ``adasum`` rows
    (one tensor per message, as ``bench sweep`` sends); 0 when the sweep has none."""
    mine = [r for r in rows if r["op"] == "adasum" and int(r["ranks"]) >= 2]
    if not mine:
        return 0.0
    base = np.array(
        [adasum_allreduce(net, int(r["ranks"]), float(r["bytes"]), tensors=1, gamma_adasum=0.0) for r in mine]
    )
    per_gamma = (
        np.array([adasum_allreduce(net, int(r["ranks"]), float(r["bytes"]), tensors=1, gamma_adasum=1.0) for r in mine])
        - base
    )
    seconds = np.array([float(r["seconds"]) for r in mine])
    weights = 1 / seconds
    (gamma,) = _nonnegative_lstsq((per_gamma * weights)[:, None], (seconds - base) * weights)
    return float(gamma)


def fit_window(
    rows: Sequence[Mapping[str, float | str]], *, path: str = "shared", layout: str = "sharded"
) -> dict[str, Network]:
    """Per mode ("locked", "wild"): alpha and beta of :func:`.network.window_exchange`
    fitted to the ``path`` and ``layout`` rows at 2 ranks or more (weighted by 1/t)."""
    fits = {}
    for mode in ("locked", "wild"):
        mine = [
            r
            for r in rows
            if r["path"] == path and r["layout"] == layout and r["mode"] == mode and int(r["ranks"]) >= 2
        ]
        if len({(int(r["ranks"]), float(r["bytes"])) for r in mine}) < 2:
            raise InputError(
                f"too few {mode} {layout} rows on the {path} path to fit a window exchange "
                "(need two sizes or rank counts; paths present: "
                f"{', '.join(sorted({str(r['path']) for r in rows})) or 'none'})"
            )
        locked = mode == "locked"
        design = np.array(
            [
                [
                    window_exchange(
                        Network(alpha=1.0, beta=0.0), int(r["ranks"]), float(r["bytes"]), locked=locked, layout=layout
                    ),
                    window_exchange(
                        Network(alpha=0.0, beta=1.0), int(r["ranks"]), float(r["bytes"]), locked=locked, layout=layout
                    ),
                ]
                for r in mine
            ]
        )
        seconds = np.array([float(r["seconds"]) for r in mine])
        weights = 1 / seconds
        alpha, beta = _nonnegative_lstsq(design * weights[:, None], seconds * weights)
        fits[mode] = Network(alpha=float(alpha), beta=float(beta), name=f"{mode} window exchange, {path} path")
    return fits


def relative_errors(rows: Sequence[Mapping[str, float | str]], net: Network, *, op: str) -> list[float]:
    """(model - measured) / measured for each ``op`` row at 2 ranks or more."""
    return [
        (net.allreduce(int(r["ranks"]), float(r["bytes"])) - float(r["seconds"])) / float(r["seconds"])
        for r in rows
        if r["op"] == op and int(r["ranks"]) >= 2
    ]


def _free(cores: float, outside: float) -> SharedCores:
    """The cores left to a job while other processes keep ``outside`` of ``cores`` busy."""
    return SharedCores(cores=max(cores - outside, MIN_FREE_CORES))


def fit_contention(rows: Sequence[Mapping[str, float]], cores: float) -> tuple[float, float, float]:
    """A workload's ``memory``, ``contention`` and ``crowding`` (:mod:`.sharing`) from its steps at several rank counts.

    ``rows``: ``ranks``, ``seconds`` (a rank's step, every rank computing at once, none
    communicating) and ``outside_cores`` (what other processes used meanwhile); the
    one-rank row is the step alone. Least squares of ``t_p / (t_1 (1 + x)) - 1`` on the
    share of the other cores busy, ``min(x, 1)`` and ``max(x - 1, 0)`` (``x``: ranks a core
    beyond the first), each bounded at 0; a term no row reaches fits 0 (``contention``
    without a row of more ranks than cores, ``crowding`` without one of more than two a core).
    """
    alone = [r for r in rows if int(r["ranks"]) == 1]
    if len(alone) != 1:
        raise InputError(f"a contention fit needs one 1-rank row, got {len(alone)}")
    one = float(alone[0]["seconds"]) / (1 + _free(cores, float(alone[0]["outside_cores"])).extra(1))
    points = []
    for r in rows:
        free, p = _free(cores, float(r["outside_cores"])), int(r["ranks"])
        if p > 1:
            x = free.extra(p)
            points.append((free.busy(p), min(x, 1.0), max(x - 1.0, 0.0), float(r["seconds"]) / (one * (1 + x)) - 1))
    if not points:
        raise InputError("no row has more than one rank: nothing to fit the contention to")
    columns = np.array([terms for *terms, _ in points])
    memory, contention, crowding = _nonnegative_lstsq(columns, np.array([y for *_, y in points]))
    return float(memory), float(contention), float(crowding)


def fit_through_origin(points: Sequence[tuple[float, float]]) -> float:
    """The least-squares ``c`` of ``y = c x`` over ``(x, y)`` points, bounded at 0 (0 with no x > 0)."""
    denominator = sum(x * x for x, _ in points)
    return max(0.0, sum(x * y for x, y in points) / denominator) if denominator > 0 else 0.0


def fit_scale_and_latency(points: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """The least-squares ``(c, s)`` of ``y = c x + k s`` over ``(x, k, y)`` points, both bounded at 0.

    ``x``: an exchange's price, ``k``: how many latency terms it pays, ``y``: what it
    cost: a factor on the price and a fixed cost per latency term (a lock that waits for
    its target to make progress costs about as much whatever the bytes).
    """
    if not points:
        return 0.0, 0.0
    columns = np.array([(x, k) for x, k, _ in points], dtype=float)
    scale, latency = _nonnegative_lstsq(columns, np.array([y for *_, y in points], dtype=float))
    return float(scale), float(latency)


def fit_node_sum(rows: Sequence[Mapping[str, float | str]], *, op: str = "bucketed") -> NodeMemory:
    """The node's memory bandwidth and counter wait fitted to the ``op`` rows of one rank
    count, every rank on one node (:func:`.node.node_sum`: ``waits x sync_s + moved / node_Bps``,
    linear in ``sync_s`` and ``1 / node_Bps``; weighted by 1/t, bounded at 0)."""
    mine = [r for r in rows if r["op"] == op]
    counts = {int(r["ranks"]) for r in mine}
    if len(counts) != 1 or min(counts) < 2 or len({float(r["bytes"]) for r in mine}) < 2:
        raise InputError(
            f"a node-sum fit needs '{op}' rows of one rank count (2 or more) at two sizes or more, "
            f"got rank counts {sorted(counts) or 'none'}"
        )
    (p,) = counts
    with_wait, bytes_only = NodeMemory(node_Bps=1.0, sync_s=1.0), NodeMemory(node_Bps=1.0, sync_s=0.0)
    design = np.array(
        [
            [node_sum(with_wait, p, n) - node_sum(bytes_only, p, n), node_sum(bytes_only, p, n)]
            for n in (float(r["bytes"]) for r in mine)
        ]
    )
    seconds = np.array([float(r["seconds"]) for r in mine])
    weights = 1 / seconds
    sync, per_byte = _nonnegative_lstsq(design * weights[:, None], seconds * weights)
    if per_byte <= 0:
        raise InputError(f"the '{op}' rows at {p} ranks do not grow with the bytes: no bandwidth to fit")
    return NodeMemory(node_Bps=1 / float(per_byte), sync_s=float(sync))
