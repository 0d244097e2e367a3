"""Alpha and beta (and Adasum's gamma) from an allreduce sweep (``bench sweep --csv``).

The sweep's rows give the latency of one allreduce of ``bytes`` at ``ranks``. For a
chosen algorithm the model is linear in its parameters, ``t = alpha A(p) + beta B(p, n)``
(:mod:`.network`), so a least-squares fit over every size and rank count recovers them.
Rows are weighted by 1/t, so that the 4-byte and the 64-MiB rows count alike (the fit
minimises relative error). gamma cannot be told apart from beta in an allreduce (both
scale with (p-1)/p n) and is left in beta; Adasum's extra per-byte work is fitted from
the ``adasum`` rows as ``gamma_adasum`` on top of the fitted network.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from ..options import InputError
from .network import Algorithm, Network, adasum_allreduce

#: Columns a sweep CSV must have.
SWEEP_COLUMNS = ("ranks", "op", "bytes", "latency_us")


def read_sweep(paths: Iterable[Path | str]) -> list[dict[str, float | str]]:
    """The rows of sweep CSVs: ``ranks``, ``op``, ``bytes``, ``seconds``."""
    rows: list[dict[str, float | str]] = []
    for path in paths:
        try:
            with open(path, newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                missing = [c for c in SWEEP_COLUMNS if c not in (reader.fieldnames or ())]
                if missing:
                    raise InputError(f"{path}: not a sweep CSV (missing columns: {', '.join(missing)})")
                for row in reader:
                    rows.append({"ranks": int(row["ranks"]), "op": row["op"], "bytes": float(row["bytes"]),
                                 "seconds": float(row["latency_us"]) * 1e-6})
        except OSError as err:
            raise InputError(f"cannot read sweep CSV {path}: {err.strerror}") from None
        except ValueError as err:
            raise InputError(f"{path}: bad value in a sweep row ({err})") from None
    return rows


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


def fit_network(rows: Sequence[Mapping[str, float | str]], *, op: str = "mpi", algorithm: Algorithm = "ring",
                name: str = "calibrated") -> Network:
    """alpha and beta of ``algorithm`` fitted to the ``op`` rows at 2 ranks or more."""
    if algorithm == "auto":
        raise InputError("calibration fits one algorithm's formula: ring or halving-doubling, not auto")
    mine = [r for r in rows if r["op"] == op and int(r["ranks"]) >= 2]
    if len({(int(r["ranks"]), float(r["bytes"])) for r in mine}) < 2:
        raise InputError(f"the sweep has too few '{op}' rows to fit alpha and beta (ops present: "
                         f"{', '.join(sorted({str(r['op']) for r in rows})) or 'none'})")
    unit_alpha, unit_beta = Network(alpha=1.0, beta=0.0, algorithm=algorithm), Network(alpha=0.0, beta=1.0, algorithm=algorithm)
    design = np.array([[unit_alpha.allreduce(int(r["ranks"]), float(r["bytes"])),
                        unit_beta.allreduce(int(r["ranks"]), float(r["bytes"]))] for r in mine])
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
    base = np.array([adasum_allreduce(net, int(r["ranks"]), float(r["bytes"]), tensors=1, gamma_adasum=0.0) for r in mine])
    per_gamma = np.array([adasum_allreduce(net, int(r["ranks"]), float(r["bytes"]), tensors=1, gamma_adasum=1.0) for r in mine]) - base
    seconds = np.array([float(r["seconds"]) for r in mine])
    weights = 1 / seconds
    (gamma,) = _nonnegative_lstsq((per_gamma * weights)[:, None], (seconds - base) * weights)
    return float(gamma)


def relative_errors(rows: Sequence[Mapping[str, float | str]], net: Network, *, op: str) -> list[float]:
    """(model - measured) / measured for each ``op`` row at 2 ranks or more."""
    return [(net.allreduce(int(r["ranks"]), float(r["bytes"])) - float(r["seconds"])) / float(r["seconds"])
            for r in rows if r["op"] == op and int(r["ranks"]) >= 2]
