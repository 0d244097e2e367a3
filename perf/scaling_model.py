"""The performance model: calibrated on this machine, checked against the scaling study,
projected to 16-1,024 GPUs.

Write-up, figures and provenance: docs/studies/performance-model.md.

1. Calibration, from perf/model_calibration.py's runs (``--calibration``, default
   perf/results/model_calibration/; none of them a scaling-study run):

   - alpha and beta fitted to the ``bucketed`` rows of its sweep (``sweep_n<P>.csv``: the
     solvers' own allreduce path), Adasum's gamma to its ``adasum`` rows, once per rank
     count; the window exchange's alpha and beta, per mode (locked, wild), to its
     ``bench windows`` rows (``windows_n<P>.csv``, shared path, sharded layout);
   - how much dearer a training step pays each exchange (allreduce, locked and wild
     windows) than those benchmarks' hot loops: a factor on the price and a fixed cost per
     latency term, fitted to what the synthetic workload's runs (``sync_<numel>/scaling.csv``
     and its repeats ``sync_<numel>-<K>/``: ``allreduce``, ``async-sgd``, ``hogwild-sgd``)
     took beyond their 1-rank iteration at 2 to as many ranks as cores (no core shared),
     against the benchmarks' price; every exchange below is priced so;
   - the host work a micro-batch of abs-sgd (its round's bookkeeping) and of adasum (its
     delta's passes) at several ranks, which their one-rank steps skip, per gradient byte
     and fixed, fitted to their runs in the same tables (``fit_host_work``;
     ``sharing.json``'s ``host_work``);
   - each study workload's compute memory, contention and crowding (:mod:`mpisolve.perfmodel.sharing`)
     fitted to P one-rank trainings at once (``compute.csv`` and its repeats, ``compute-<K>.csv``,
     fitted together);
   - the machine's cost of a blocking exchange and of a lock acquisition per extra rank a
     core, per rank count above the cores, fitted to what the synthetic workload's runs
     (``sync_<numel>/scaling.csv``: ``allreduce``, ``async-sgd``) leave over their compute
     (its memory, contention and crowding fitted to its ``hogwild-sgd`` runs, which neither block nor lock) and
     their exchanges' price; none at as many ranks as cores or fewer.

2. Validation: for each series, model and solver of the scaling study (its repeats at the
   current code, ``perf/results/scaling/repeat-<k>/scaling.csv``, which record the other
   processes' load; the median of each run's iteration and load), the model is given the
   measured 1-rank iteration of the same series as the compute, the cores the run had (the
   machine's, less what other processes used meanwhile: ``outside_cores``) and the
   calibration, and predicts the 2-8 rank iteration, each solver on its own schedule (tau)
   and exchange. An ``emulated`` rank sleeps through its device time: only its host work
   (the 1-rank iteration less the device time) shares the cores. ``error_alpha_beta`` keeps
   what the model gives without the sharing terms (its exchanges still priced as a training
   step pays them). The relative errors go to validation.csv,
   validation.md (the study's tables: per run, and per solver) and validation.png.
3. Projection: ``python -m mpisolve model`` for ResNet-18 and ResNet-50 on 100 Gb/s
   InfiniBand with H100-class compute, 16 to 1,024 GPUs: projection_<model>.csv, the
   command's printed table (projection_<model>.txt) and projection.png.

Everything goes to perf/results/scaling_model/ (``--out``)::

    python perf/scaling_model.py
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from launch import RESULTS

from mpisolve.perfmodel.calibrate import (
    MIN_FREE_CORES,
    fit_adasum_gamma,
    fit_contention,
    fit_network,
    fit_node_sum,
    fit_scale_and_latency,
    fit_through_origin,
    fit_window,
    read_sweep,
    read_window_bench,
)
from mpisolve.perfmodel.iteration import MODELS, Case, Compute, iteration, model_options
from mpisolve.perfmodel.network import Network, window_exchange
from mpisolve.perfmodel.sharing import SharedCores
from mpisolve.perfmodel.workloads import Workload, workload

OUT = RESULTS / "scaling_model"
CALIBRATION = RESULTS / "model_calibration"
PROJECTED = ("allreduce", "adasum", "easgd", "local-sgd", "async-sgd", "ea-wild", "kfac")
PROJECTION_RANKS = "16,32,64,128,256,512,1024"
WIRE_BYTES = 4


#: The synthetic workload's solvers whose runs price each exchange in a training loop, and the exchange.
IN_LOOP = {"allreduce": "allreduce", "async-sgd": "locked", "hogwild-sgd": "wild"}
#: Other processes' load (cores) above which a synthetic run is left out of the in-loop fit.
QUIET_CORES = 0.25
#: A workload's compute sharing terms (:class:`SharedCores`), in the order :func:`fit_contention` gives them.
SHARING_TERMS = ("memory", "contention", "crowding")


#: The latency (s) added to find how many latency terms an exchange pays (its prices are linear in it).
PROBE_LATENCY_S = 1e-4


def sharing_terms(terms: dict[str, float]) -> str:
    """A workload's compute sharing terms in words."""
    return (
        f"memory {terms['memory']:.3f} with every core busy, contention {terms['contention']:.3f} at two ranks a "
        f"core, crowding {terms['crowding']:.3f} per further rank a core"
    )


def in_loop(net: Network, factor: float, latency_s: float = 0.0) -> Network:
    """``net`` with every term ``factor`` times dearer and ``latency_s`` more per latency
    term (each alpha, each counter wait): an exchange as a training step pays it. A factor of
    0 (a fit that found the bytes free in the loop) leaves the latency terms alone."""
    memory = net.memory and replace(
        net.memory,
        node_Bps=net.memory.node_Bps / factor if factor > 0 else math.inf,
        sync_s=net.memory.sync_s * factor + latency_s,
    )
    intra = None if net.intra_beta is None else net.intra_beta * factor
    return replace(
        net,
        alpha=net.alpha * factor + latency_s,
        beta=net.beta * factor,
        gamma=net.gamma * factor,
        intra_beta=intra,
        memory=memory,
    )


@dataclass(frozen=True)
class Calibration:
    """What the model knows of this machine: per rank count the allreduce network, Adasum's
    gamma, the fit's median error and the window networks (as the benchmarks measured them);
    per exchange (``allreduce``, ``locked``, ``wild``) how much dearer a training step pays
    it, a factor and a latency (:func:`in_loop`; :meth:`network`, :meth:`window_networks`);
    the cores; per (series, model) the compute's sharing terms (:data:`SHARING_TERMS`); per rank count the cost of a
    wait and of a lock per extra rank a core; per solver with host work at several ranks
    (:data:`HOST_WORK`), that work a micro-batch, per gradient byte and fixed (absent: not
    measured)."""

    nets: dict[int, tuple[Network, float, float]]
    windows: dict[int, dict[str, Network]]
    cores: int
    in_loop: dict[str, tuple[float, float]]
    compute: dict[tuple[str, str], dict[str, float]]
    wait_s: dict[int, float]
    lock_s: dict[int, float]
    host: dict[str, tuple[float, float]] = field(default_factory=dict)

    def network(self, p: int) -> tuple[Network, float]:
        """The allreduce network and Adasum's gamma at ``p`` ranks, priced in a training loop."""
        net, gamma, _ = self.nets[p]
        factor, latency_s = self.in_loop.get("allreduce", (1.0, 0.0))
        return in_loop(net, factor, latency_s), gamma * factor

    def window_networks(self, p: int) -> dict[str, Network] | None:
        """The window exchange's networks at ``p`` ranks by mode, priced in a training loop."""
        nets = self.windows.get(p)
        return None if nets is None else {m: in_loop(n, *self.in_loop.get(m, (1.0, 0.0))) for m, n in nets.items()}


def calibrate_networks(directory: Path) -> dict[int, tuple[Network, float, float]]:
    """Per rank count: the fitted network, Adasum's gamma, the node-sum fit's median |relative error|.

    The solvers' bucketed sums on one node go through node-shared memory: priced by the
    node's memory bandwidth and counter wait (:func:`fit_node_sum`); alpha and beta
    (halving-doubling) carry Adasum, whose gamma is fitted on top. One fit per rank count:
    on an oversubscribed machine they change with the number of ranks sharing the cores.
    """
    rows = read_sweep(sorted(directory.glob("sweep_n*.csv")))
    fits = {}
    for p in sorted({int(r["ranks"]) for r in rows}):
        mine = [r for r in rows if int(r["ranks"]) == p]
        links = fit_network(mine, op="bucketed", algorithm="halving-doubling", name=f"this machine, {p} ranks")
        net = replace(links, per_node=p, memory=fit_node_sum(mine))
        errors = [
            abs(net.allreduce(p, float(r["bytes"])) / float(r["seconds"]) - 1) for r in mine if r["op"] == "bucketed"
        ]
        fits[p] = (net, fit_adasum_gamma(mine, links), statistics.median(errors))
        memory = net.memory
        assert memory is not None
        print(
            f"calibration at {p} ranks: node sums {memory.node_Bps / 1e9:.2f} GB/s, {memory.sync_s * 1e6:.1f} us a wait"
            f" (|error| over the bucketed rows: median {fits[p][2]:.0%}, max {max(errors):.0%}); alpha "
            f"{net.alpha * 1e6:.1f} us, beta {net.beta * 1e9:.3f} ns/B, gamma_adasum {fits[p][1] * 1e9:.3f} ns/B"
        )
    return fits


def calibrate_windows(directory: Path) -> dict[int, dict[str, Network]]:
    """Per rank count: the window exchange's fitted network per mode ("locked", "wild")."""
    rows = read_window_bench(sorted(directory.glob("windows_n*.csv")))
    fits = {}
    for p in sorted({int(r["ranks"]) for r in rows}):
        mine = [r for r in rows if int(r["ranks"]) == p]
        fits[p] = fit_window(mine)
        for mode, net in fits[p].items():
            errors = [
                abs(window_exchange(net, p, float(r["bytes"]), locked=mode == "locked") - float(r["seconds"]))
                / float(r["seconds"])
                for r in mine
                if r["mode"] == mode and r["layout"] == "sharded" and r["path"] == "shared"
            ]
            print(
                f"window calibration at {p} ranks, {mode}: alpha {net.alpha * 1e6:.1f} us, "
                f"beta {net.beta * 1e9:.3f} ns/B; "
                f"|error| over its rows: max {max(errors):.0%}"
            )
    return fits


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def free_cores(cores: int, row: dict[str, str]) -> float:
    """The cores a run had: the machine's less what other processes used meanwhile."""
    return max(cores - float(row["outside_cores"] or 0), MIN_FREE_CORES)


def calibrate(directory: Path) -> Calibration:
    cores = int(json.loads((directory / "machine.json").read_text())["cores"])
    nets, windows = calibrate_networks(directory), calibrate_windows(directory)
    fits: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for path in sorted(directory.glob("compute*.csv")):  # a repeat each, with its own 1-rank rows
        rows = read_rows(path)
        for key in dict.fromkeys((r["series"], r["model"]) for r in rows):
            mine = [
                {
                    "ranks": float(r["ranks"]),
                    "seconds": float(r["iteration_s"]),
                    "outside_cores": float(r["outside_cores"]),
                }
                for r in rows
                if (r["series"], r["model"]) == key
            ]
            fits.setdefault(key, []).append(fit_contention(mine, cores))
    compute: dict[tuple[str, str], dict[str, float]] = {}
    for (series, model), values in fits.items():
        compute[(series, model)] = dict(zip(SHARING_TERMS, (statistics.median(v) for v in zip(*values))))
        print(f"{model} ({series}): {sharing_terms(compute[(series, model)])}")
    syncs = [
        (
            Workload("synthetic", int(json.loads((sync.parent / "workload.json").read_text())["numel"]), 3, ()),
            {(r["solver"], int(r["ranks"])): r for r in read_rows(sync)},
        )
        for sync in sorted(directory.glob("sync_*/scaling.csv"))
    ]
    cal = Calibration(nets, windows, cores, {}, compute, {}, {})
    cal = replace(cal, in_loop=fit_in_loop(cal, syncs))
    cal = replace(cal, host={s: fit for s in HOST_WORK if (fit := fit_host_work(cal, syncs, s)) is not None})
    waits: dict[int, list[tuple[float, float]]] = {}
    locks: dict[int, list[tuple[float, float]]] = {}
    for load, rows in syncs:
        ranks = sorted({p for s, p in rows if s == "hogwild-sgd" and p > 1})
        shared = [p for p in ranks if p > cores]  # where ranks share cores by their number
        if not shared:  # a repeat at no more ranks than cores: the in-loop fit's alone
            continue
        # the synthetic workload's compute: hogwild-sgd's iteration less its wild exchange
        hogwild = [
            {
                "ranks": float(p),
                "seconds": float(rows[("hogwild-sgd", p)]["iteration_s"])
                - (
                    window_exchange(cal.window_networks(p)["wild"], p, load.params * WIRE_BYTES, locked=False)
                    if p > 1
                    else 0.0
                ),
                "outside_cores": float(rows[("hogwild-sgd", p)]["outside_cores"] or 0),
            }
            for p in [1, *ranks]
        ]
        terms = dict(zip(SHARING_TERMS, fit_contention(hogwild, cores)))
        for solver, into in (("allreduce", waits), ("async-sgd", locks)):
            one = float(rows[(solver, 1)]["iteration_s"])
            for p in shared:
                row = rows[(solver, p)]
                plain = SharedCores(cores=free_cores(cores, row), **terms)
                net, gamma = cal.network(p)
                compute = Compute(step_s=one, batch=32, sharing=plain)
                case = Case(load, net, compute, p, WIRE_BYTES, gamma, cal.window_networks(p))
                left = float(row["iteration_s"]) - iteration(solver, case).total
                count = 1.0 if solver == "allreduce" else 2.0 * (p - 1)  # blocking exchanges, lock acquisitions
                into.setdefault(p, []).append((count * plain.extra(p), left))
        print(f"synthetic workload, {load.params} parameters: {sharing_terms(terms)}")
    wait_s = {p: fit_through_origin(points) for p, points in waits.items()}
    lock_s = {p: fit_through_origin(points) for p, points in locks.items()}
    for p in wait_s:
        print(
            f"at {p} ranks, per extra rank a core: a blocking exchange {wait_s[p] * 1e3:.2f} ms, "
            f"a lock acquisition {lock_s[p] * 1e3:.2f} ms"
        )
    return replace(cal, wait_s=wait_s, lock_s=lock_s)


def benchmark_price(
    cal: Calibration, solver: str, exchange: str, load: Workload, p: int, compute: Compute
) -> Callable[[float], float]:
    """``solver``'s exchange at ``p`` ranks at the benchmarks' price, as a function of the
    latency (s) added to each of the latency terms of ``exchange``'s network."""
    net, gamma, _ = cal.nets[p]

    def price(latency_s: float) -> float:
        windows = {m: in_loop(n, 1.0, latency_s if m == exchange else 0.0) for m, n in cal.windows.get(p, {}).items()}
        probed = in_loop(net, 1.0, latency_s if exchange == "allreduce" else 0.0)
        it = iteration(solver, Case(load, probed, compute, p, WIRE_BYTES, gamma, windows or None))
        return it.total - it.compute

    return price


def quiet_pairs(
    cal: Calibration, syncs: list[tuple[Workload, dict[tuple[str, int], dict[str, str]]]], solver: str, fit: str
) -> Iterator[tuple[Workload, int, dict[str, str], dict[str, str]]]:
    """The synthetic workload's runs of ``solver`` at 2 to as many ranks as cores (no core
    shared), each with its 1-rank run: ``(workload, ranks, 1-rank row, row)``, only pairs
    during which other processes used at most :data:`QUIET_CORES` (the others are said)."""
    for load, rows in syncs:
        if (solver, 1) not in rows:
            continue
        one = rows[(solver, 1)]
        for p in sorted(q for s, q in rows if s == solver and 1 < q <= cal.cores):
            row = rows[(solver, p)]
            if max(float(r["outside_cores"] or 0) for r in (one, row)) > QUIET_CORES:
                print(f"{fit}: {solver} at 1 and {p} ranks, {load.params} parameters, left out (other load)")
                continue
            yield load, p, one, row


def fit_in_loop(
    cal: Calibration, syncs: list[tuple[Workload, dict[tuple[str, int], dict[str, str]]]]
) -> dict[str, tuple[float, float]]:
    """How much dearer a training step pays each exchange than the benchmarks measured it:
    a factor on their price and a fixed cost per latency term (:func:`in_loop`).

    Fitted, per exchange, to the synthetic workload's quiet runs of its solver
    (:data:`IN_LOOP`, :func:`quiet_pairs`): what a run took beyond its 1-rank iteration
    against the benchmarks' price of its exchange and the number of latency terms it pays
    (least squares, both bounded at 0, over the workload's sizes and those rank counts).
    An exchange with no quiet runs keeps the benchmarks' price.
    """
    points: dict[str, list[tuple[float, float, float]]] = {}
    for solver, exchange in IN_LOOP.items():
        for load, p, one, row in quiet_pairs(cal, syncs, solver, "in-loop fit"):
            compute = Compute(step_s=float(one["iteration_s"]), batch=32)
            price = benchmark_price(cal, solver, exchange, load, p, compute)
            plain = price(0.0)
            latencies = (price(PROBE_LATENCY_S) - plain) / PROBE_LATENCY_S
            points.setdefault(exchange, []).append((plain, latencies, float(row["iteration_s"]) - compute.seconds(p)))
    fits = {exchange: fit_scale_and_latency(xyz) for exchange, xyz in points.items()}
    for exchange, (factor, latency_s) in fits.items():
        print(
            f"in a training loop, {exchange} exchanges cost {factor:.2f}x the benchmarks' price "
            f"and {latency_s * 1e3:.3f} ms more per latency term"
        )
    return {exchange: fit for exchange, fit in fits.items() if any(fit)}


#: Solvers whose step at several ranks does host work their one-rank step skips, fitted per solver.
HOST_WORK = ("abs-sgd", "adasum")


def fit_host_work(
    cal: Calibration, syncs: list[tuple[Workload, dict[tuple[str, int], dict[str, str]]]], solver: str
) -> tuple[float, float] | None:
    """``solver``'s host work a micro-batch at several ranks, seconds per gradient byte and
    fixed (:attr:`Case.host_s_per_byte`, :attr:`Case.host_s`): what the synthetic
    workload's quiet runs of ``solver`` (:func:`quiet_pairs`) took beyond the model's
    iteration without it (its exchange priced as a training step pays it), least squares
    over the workload's sizes, both bounded at 0; None without any."""
    points = []
    for load, p, one, row in quiet_pairs(cal, syncs, solver, f"{solver}'s host-work fit"):
        net, gamma = cal.network(p)
        compute = Compute(step_s=float(one["iteration_s"]), batch=32)
        case = Case(load, net, compute, p, WIRE_BYTES, gamma, cal.window_networks(p), host_s_per_byte=0.0)
        points.append((case.grad_bytes, 1.0, float(row["iteration_s"]) - iteration(solver, case).total))
    if not points:
        return None
    per_byte, fixed = fit_scale_and_latency(points)
    print(
        f"{solver}'s host work at several ranks: {per_byte * 1e9:.3f} ns a gradient byte, "
        f"{fixed * 1e3:.3f} ms a micro-batch"
    )
    return per_byte, fixed


def host_work(cal: Calibration, solver: str) -> dict[str, float]:
    """The :class:`Case` fields of ``solver``'s measured host work (none where it was not measured)."""
    if solver not in cal.host:
        return {}
    per_byte, fixed = cal.host[solver]
    return {"host_s_per_byte": per_byte, "host_s": fixed}


def device_s(row: dict[str, str]) -> float:
    """The emulated device's seconds in one of a run's iterations (0 for a real run)."""
    return float(row["device_ms"] or 0) * 1e-3 * int(row["batch"])


def sharing_for(cal: Calibration, row: dict[str, str], one: dict[str, str]) -> tuple[SharedCores, float, float]:
    """The run's shared cores, the step alone its compute scales from, and the device time
    (s) that no sharing lengthens.

    The step alone is the same series' 1-rank iteration (``one``) less what sharing cost it
    (other processes may have left that rank less than a core). An emulated rank sleeps
    through its device time, and only its host work (the iteration less the device time)
    shares the cores; the exchanges wake the ranks together, so their host work runs at
    the same time and every rank counts.
    """
    p, terms = int(row["ranks"]), cal.compute.get(("real", row["model"]), {})
    device = device_s(row)
    single = float(one["iteration_s"])
    host = max(single - device_s(one), 1e-6)
    at_one = SharedCores(cores=free_cores(cal.cores, one), **terms)
    sharing = SharedCores(
        cores=free_cores(cal.cores, row),
        **terms,
        wait_s=cal.wait_s.get(p, 0.0),
        lock_s=cal.lock_s.get(p, 0.0),
    )
    return sharing, host / at_one.slowdown(1), device


def medians(paths: list[Path]) -> list[dict[str, str]]:
    """The study's runs, one row per series, model, solver and rank count: the median over
    the CSVs (repeats of the study) of its iteration and of the other processes' load.

    An emulated run's device time is set per repeat (from that repeat's solo compute), so
    its iteration is the median of the host's part plus the median device time, the device
    time the row then gives (its ``device_ms``): the 1-rank row's host part stays its own.
    """
    runs: dict[tuple[str, ...], list[dict[str, str]]] = {}
    for path in paths:
        for r in read_rows(path):
            runs.setdefault((r["series"], r["model"], r["solver"], r["ranks"]), []).append(r)
    rows = []
    for repeats in runs.values():
        device_ms = statistics.median(float(r["device_ms"] or 0) for r in repeats)
        host_s = statistics.median(float(r["iteration_s"]) - device_s(r) for r in repeats)
        row = {**repeats[0], "device_ms": str(device_ms) if repeats[0]["device_ms"] else ""}
        row |= {
            "iteration_s": str(host_s + device_s(row)),
            "outside_cores": str(statistics.median(float(r["outside_cores"] or 0) for r in repeats)),
            "repeats": str(len(repeats)),
        }
        rows.append(row)
    return rows


def validate(cal: Calibration, scaling_csvs: list[Path]) -> list[dict[str, object]]:
    measured = medians(scaling_csvs)
    single = {(r["series"], r["model"], r["solver"]): r for r in measured if int(r["ranks"]) == 1}
    loads: dict[str, Workload] = {}
    out = []
    for r in measured:
        p, key = int(r["ranks"]), (r["series"], r["model"], r["solver"])
        if p == 1 or p not in cal.nets or key not in single or r["solver"] not in MODELS:
            continue
        net, gamma_adasum = cal.network(p)
        load = loads.setdefault(r["model"], workload(r["model"]))
        sharing, alone, fixed = sharing_for(cal, r, single[key])
        options = model_options(r["solver"], {})
        runs = {
            shared: iteration(
                r["solver"],
                Case(
                    load,
                    net,
                    Compute(step_s=alone, batch=int(r["batch"]), sharing=shared),
                    p,
                    WIRE_BYTES,
                    gamma_adasum,
                    cal.window_networks(p),
                    **host_work(cal, r["solver"]),
                ),
                options,
            )
            for shared in (sharing, None)
        }
        it, alpha_beta = runs[sharing], runs[None]
        seen = float(r["iteration_s"])
        out.append(
            {
                "series": r["series"],
                "model": r["model"],
                "solver": r["solver"],
                "ranks": p,
                "repeats": int(r["repeats"]),
                "free_cores": free_cores(cal.cores, r),
                "measured_ms": seen * 1e3,
                "predicted_ms": (it.total + fixed) * 1e3,
                "compute_ms": (it.compute + fixed) * 1e3,
                "comm_ms": it.comm * 1e3,
                "error": (it.total + fixed - seen) / seen,
                "error_alpha_beta": (alpha_beta.total + fixed - seen) / seen,
            }
        )
    return out


def validation_tables(validation: list[dict[str, object]]) -> list[str]:
    """The study's validation tables: every run, then the error per solver."""
    lines = [
        "| series | model | solver | measured 2 / 4 / 8 ranks (ms) | model (ms) | error 2 | error 4 | error 8 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for series, model, solver in dict.fromkeys((r["series"], r["model"], r["solver"]) for r in validation):
        at = {r["ranks"]: r for r in validation if (r["series"], r["model"], r["solver"]) == (series, model, solver)}
        measured = " / ".join(f"{at[p]['measured_ms']:.1f}" if p in at else "-" for p in (2, 4, 8))
        predicted = " / ".join(f"{at[p]['predicted_ms']:.1f}" if p in at else "-" for p in (2, 4, 8))
        errors = " | ".join(f"{at[p]['error']:+.0%}" if p in at else "" for p in (2, 4, 8))
        lines.append(f"| {series} | {model} | {solver} | {measured} | {predicted} | {errors} |")
    abs_errors = [abs(float(r["error"])) for r in validation]
    plain = [abs(float(r["error_alpha_beta"])) for r in validation]
    lines.append(
        f"\n|error| over {len(abs_errors)} runs: median {statistics.median(abs_errors):.0%}, "
        f"max {max(abs_errors):.0%} (the alpha-beta terms alone: median {statistics.median(plain):.0%}, "
        f"max {max(plain):.0%}).\n"
    )
    lines += [
        "| solver | runs | median abs. error, real | median abs. error, emulated | median abs. error, all | "
        "all, alpha-beta alone (no sharing terms) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]

    def median(rows: list[dict[str, object]], key: str = "error") -> str:
        return f"{statistics.median(abs(float(r[key])) for r in rows):.0%}" if rows else "-"

    for solver in sorted({r["solver"] for r in validation}):
        mine = [r for r in validation if r["solver"] == solver]
        lines.append(
            f"| {solver} | {len(mine)} | {median([r for r in mine if r['series'] == 'real'])} | "
            f"{median([r for r in mine if r['series'] == 'emulated'])} | {median(mine)} | "
            f"{median(mine, 'error_alpha_beta')} |"
        )
    return lines


def project(out: Path) -> dict[str, Path]:
    written = {}
    for model in ("resnet18", "resnet50"):
        path = out / f"projection_{model}.csv"
        command = [
            sys.executable,
            "-m",
            "mpisolve",
            "model",
            "--solver",
            ",".join(PROJECTED),
            "--model",
            model,
            "--ranks",
            PROJECTION_RANKS,
            "--csv",
            str(path),
        ]
        print("+", " ".join(command[1:]), flush=True)
        printed = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
        print(printed, end="")
        (out / f"projection_{model}.txt").write_text("$ python -m mpisolve " + " ".join(command[3:-2]) + "\n" + printed)
        written[model] = path
    return written


def projection_table(projections: dict[str, Path]) -> str:
    """The study's table: efficiency at 16, 128 and 1,024 GPUs and the iteration at 1,024, per model and solver."""
    lines = [
        "| model | solver | efficiency 16 / 128 / 1,024 GPUs | iteration at 1,024 (ms): compute + exposed comm |",
        "| --- | --- | --- | --- |",
    ]
    for model, path in projections.items():
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        for solver in dict.fromkeys(r["solver"] for r in rows):
            at = {int(r["ranks"]): r for r in rows if r["solver"] == solver}
            effs = " / ".join(f"{float(at[p]['efficiency']):.2f}" for p in (16, 128, 1024) if p in at)
            last = at[max(at)]
            lines.append(
                f"| {model} | {solver} | {effs} | {float(last['iteration_ms']):.1f} = "
                f"{float(last['compute_ms']):.1f} + {float(last['exposed_ms']):.1f} |"
            )
    return "\n".join(lines) + "\n"


def plot(validation: list[dict[str, object]], projections: dict[str, Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    solvers = sorted({r["solver"] for r in validation})
    colors = plt.get_cmap("tab20")
    for i, solver in enumerate(solvers):
        labelled = False
        for model, marker in (("mlp", "o"), ("cnn", "s")):
            for series in ("real", "emulated"):
                mine = [
                    r for r in validation if r["solver"] == solver and r["model"] == model and r["series"] == series
                ]
                if not mine:
                    continue
                color = colors(i % 20)
                ax.scatter(
                    [r["measured_ms"] for r in mine],
                    [r["predicted_ms"] for r in mine],
                    marker=marker,
                    s=25,
                    color=color if series == "real" else "none",
                    edgecolors=color,
                    label=None if labelled else solver,
                )
                labelled = True
    values = [v for r in validation for v in (r["measured_ms"], r["predicted_ms"])]
    lo, hi = min(values) / 1.5, max(values) * 1.5
    ax.plot([lo, hi], [lo, hi], "k--", lw=1)
    ax.plot([lo, hi], [2 * lo, 2 * hi], "k:", lw=0.8)
    ax.plot([lo, hi], [lo / 2, hi / 2], "k:", lw=0.8)
    ax.set(
        xscale="log",
        yscale="log",
        xlim=(lo, hi),
        ylim=(lo, hi),
        xlabel="measured iteration (ms)",
        ylabel="model (ms)",
        title="model vs measured, 2-8 ranks\n(o mlp, s cnn; filled real, hollow emulated; dotted: 2x)",
    )
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "validation.png", dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(projections), figsize=(6 * len(projections), 4.8), squeeze=False)
    for ax, (model, path) in zip(axes[0], projections.items()):
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        for i, solver in enumerate(dict.fromkeys(r["solver"] for r in rows)):
            mine = [r for r in rows if r["solver"] == solver]
            ax.plot(
                [int(r["ranks"]) for r in mine],
                [float(r["efficiency"]) for r in mine],
                "-o",
                ms=4,
                color=f"C{i}",
                label=solver,
            )
        ax.set(
            xscale="log",
            ylim=(0, 1.05),
            xlabel="GPUs",
            ylabel="weak-scaling efficiency",
            title=f"{model}: 100 Gb/s InfiniBand, H100-class GPUs",
        )
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "projection.png", dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--calibration", type=Path, default=CALIBRATION, help="perf/model_calibration.py's output directory"
    )
    parser.add_argument(
        "--scaling",
        type=Path,
        nargs="+",
        default=sorted((RESULTS / "scaling").glob("repeat-*/scaling.csv")),
        help="the scaling study's CSVs (default: its repeats at the current code; the median of each run is checked)",
    )
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--no-projection", action="store_true", help="calibrate and validate only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cal = calibrate(args.calibration)
    validation = validate(cal, args.scaling)
    with (args.out / "validation.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(validation[0]))
        writer.writeheader()
        writer.writerows(validation)
    with (args.out / "calibration.csv").open("w", newline="") as f:
        csv.writer(f).writerows(
            [
                (
                    "ranks",
                    "exchange",
                    "alpha_s",
                    "beta_s_per_byte",
                    "gamma_adasum_s_per_byte",
                    "node_bytes_per_s",
                    "node_wait_s",
                    "median_abs_error",
                )
            ]
            + [
                (p, "allreduce", net.alpha, net.beta, gamma, net.memory.node_Bps, net.memory.sync_s, error)
                for p, (net, gamma, error) in cal.nets.items()
                if net.memory is not None
            ]
            + [
                (p, f"window {mode}", net.alpha, net.beta, "", "", "", "")
                for p, nets in cal.windows.items()
                for mode, net in nets.items()
            ]
        )
    (args.out / "sharing.json").write_text(
        json.dumps(
            {
                "cores": cal.cores,
                "in_loop": {exchange: {"factor": f, "latency_s": s} for exchange, (f, s) in cal.in_loop.items()},
                "compute": {f"{series} {model}": terms for (series, model), terms in cal.compute.items()},
                "wait_s": cal.wait_s,
                "lock_s": cal.lock_s,
                "host_work": {s: {"s_per_byte": b, "s": f} for s, (b, f) in cal.host.items()},
            },
            indent=1,
        )
        + "\n"
    )
    lines = validation_tables(validation)
    lines += [
        "",
        "| ranks | node sums: GB/s, us a wait | median abs. error over the sweep | Adasum: alpha (us), beta (ns/B), "
        "gamma (ns/B) | window locked: alpha (us), beta (ns/B) | window wild: alpha (us), beta (ns/B) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {p} | {net.memory.node_Bps / 1e9:.2f}, {net.memory.sync_s * 1e6:.1f} | {error:.0%} | "
        f"{net.alpha * 1e6:.1f}, {net.beta * 1e9:.3f}, {gamma * 1e9:.3f} | "
        + " | ".join(
            f"{w[m].alpha * 1e6:.1f}, {w[m].beta * 1e9:.3f}" if (w := cal.windows.get(p)) else "-"
            for m in ("locked", "wild")
        )
        + " |"
        for p, (net, gamma, error) in cal.nets.items()
        if net.memory is not None
    ]
    lines += [
        "",
        "| in a training loop, and ranks sharing cores | fitted |",
        "| --- | --- |",
        *(
            f"| {exchange} exchanges | {factor:.2f}x the benchmarks' price, "
            f"{latency_s * 1e3:.3f} ms more a latency term |"
            for exchange, (factor, latency_s) in cal.in_loop.items()
        ),
        *(
            f"| {solver}'s host work at several ranks | {per_byte * 1e9:.3f} ns a gradient byte and "
            f"{fixed * 1e3:.3f} ms a micro-batch |"
            for solver, (per_byte, fixed) in cal.host.items()
        ),
        *(
            f"| compute, {model} ({series}) | {sharing_terms(terms)} |"
            for (series, model), terms in cal.compute.items()
        ),
        *(
            f"| at {p} ranks: a blocking exchange, a lock acquisition | {cal.wait_s[p] * 1e3:.2f} ms, "
            f"{cal.lock_s[p] * 1e3:.2f} ms per extra rank a core |"
            for p in sorted(cal.wait_s)
        ),
    ]
    (args.out / "validation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    written = ["calibration.csv", "sharing.json", "validation.csv/.md"]
    if not args.no_projection:
        projections = project(args.out)
        (args.out / "projection.md").write_text(projection_table(projections))
        print(projection_table(projections))
        plot(validation, projections, args.out)
        written += ["validation.png", "projection_*.csv/.txt", "projection.md/.png"]
    print(f"wrote {args.out}/: {', '.join(written)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
