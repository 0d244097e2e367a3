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
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from ..errors import InputError
from .network import Algorithm, Network, adasum_allreduce, window_exchange

#: Columns a sweep CSV must have.
SWEEP_COLUMNS = ("ranks", "op", "bytes", "latency_us")
#: Columns a ``bench windows`` CSV must have.
WINDOW_COLUMNS = ("ranks", "path", "mode", "layout", "bytes", "seconds")


def _read_csv(
    paths: Iterable[Path | str],
    columns: tuple[str, ...],
    kind: str,
    row_of: Callable[[dict[str, str]], dict[str, float | str]],
) -> list[dict[str, float | str]]:
    """Every row of ``kind`` CSVs at ``paths``, converted by ``row_of``; a bad file is an :class:`InputError`."""
    rows: list[dict[str, float | str]] = []
    for path in paths:
        try:
            with open(path, newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                missing = [c for c in columns if c not in (reader.fieldnames or ())]
                if missing:
                    raise InputError(f"{path}: not a {kind} CSV (missing columns: {', '.join(missing)})")
                rows.extend(row_of(row) for row in reader)
        except OSError as err:
            raise InputError(f"cannot read {kind} CSV {path}: {err.strerror}") from None
        except ValueError as err:
            raise InputError(f"{path}: bad value in a {kind} row ({err})") from None
    return rows


def read_sweep(paths: Iterable[Path | str]) -> list[dict[str, float | str]]:
    """The rows of sweep CSVs: ``ranks``, ``op``, ``bytes``, ``seconds``."""
    return _read_csv(
        paths,
        SWEEP_COLUMNS,
        "sweep",
        lambda row: {
            "ranks": int(row["ranks"]),
            "op": row["op"],
            "bytes": float(row["bytes"]),
            "seconds": float(row["latency_us"]) * 1e-6,
        },
    )


def read_window_bench(paths: Iterable[Path | str]) -> list[dict[str, float | str]]:
    """The rows of ``bench windows`` CSVs: ``ranks``, ``path``, ``mode``, ``layout``, ``bytes``, ``seconds``."""
    return _read_csv(
        paths,
        WINDOW_COLUMNS,
        "bench windows",
        lambda row: {
            "ranks": int(row["ranks"]),
            "path": row["path"],
            "mode": row["mode"],
            "layout": row["layout"],
            "bytes": float(row["bytes"]),
            "seconds": float(row["seconds"]),
        },
    )


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
