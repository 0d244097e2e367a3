"""``python -m mpisolve model``: a solver's iteration time and scaling efficiency at many GPUs.

Projects each solver's iteration (:mod:`.iteration`) on a network (a preset, a link speed
and latency, or alpha and beta fitted to ``bench sweep`` CSVs) for a workload whose
single-GPU speed is given, and prints a table (``--json``, ``--csv`` write it too).
Efficiency is weak scaling's: the solver's own iteration time at ``--baseline`` GPUs (1)
over its time at p.
No MPI is needed.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..options import option_fields
from .calibrate import fit_adasum_gamma, fit_network, fit_window, read_sweep, read_window_bench
from .iteration import MODELS, Case, Compute, iteration, model_options, parse_model_option
from .network import ALGORITHMS, Algorithm, Network
from .workloads import WORKLOADS, workload

#: Network presets: (link Gb/s, one-way latency in microseconds): InfiniBand, RDMA over
#: Ethernet (RoCE), Ethernet through TCP.
NETWORKS = {
    "ib100": (100.0, 2.0),
    "ib200": (200.0, 2.0),
    "ib400": (400.0, 2.0),
    "roce25": (25.0, 5.0),
    "eth25": (25.0, 15.0),
    "eth50": (50.0, 15.0),
}
#: One GPU's training samples/s per workload, when --throughput is not given: ``h100``, our
#: H100-class assumption (mixed precision, batch 128); ``p100``, TensorFlow's published
#: benchmarks (May 2017, NVIDIA DGX-1, synthetic ImageNet, float32, batch 64), ResNet-101's
#: put between its ResNet-50 and ResNet-152 by forward flops (a linear time per sample).
GPU_THROUGHPUT = {
    "h100": {"resnet18": 6000.0, "resnet50": 2800.0},
    "p100": {"inception-v3": 142.0, "resnet50": 219.0, "resnet101": 129.4, "resnet152": 91.8, "vgg16": 154.0},
}
#: Reduction time per byte on an H100-class GPU: three bytes moved per byte reduced at ~3 TB/s.
GPU_GAMMA = 1e-12
WIRE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_RANKS = (16, 32, 64, 128, 256, 512, 1024)
FIELDS = (
    "solver",
    "model",
    "ranks",
    "iteration_ms",
    "compute_ms",
    "comm_ms",
    "exposed_ms",
    "efficiency",
    "samples_per_s",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--solver", default="all", metavar="A,B,...", help=f"solvers, or 'all' (modelled: {', '.join(MODELS)})"
    )
    parser.add_argument(
        "--ranks",
        default=",".join(map(str, DEFAULT_RANKS)),
        metavar="P,Q,...",
        help="rank (GPU) counts (default %(default)s)",
    )
    parser.add_argument("--model", default="resnet50", help=f"workload: {', '.join(WORKLOADS)} (default %(default)s)")
    parser.add_argument("--batch", type=int, default=128, help="samples per GPU per iteration (default %(default)s)")
    speed = parser.add_mutually_exclusive_group()
    _override(
        speed, "--throughput", "S/s", "one GPU's training samples/s on this model (default: --gpu's figure for it)"
    )
    _override(speed, "--step-time", "SECONDS", "one GPU's iteration time instead")
    parser.add_argument(
        "--gpu",
        default="h100",
        choices=tuple(GPU_THROUGHPUT),
        help="whose samples/s to assume: "
        + "; ".join(f"{g}: " + ", ".join(f"{k} {v:g}" for k, v in t.items()) for g, t in GPU_THROUGHPUT.items())
        + " (default %(default)s)",
    )
    parser.add_argument("--network", default="ib100", help=f"preset: {', '.join(NETWORKS)} (default %(default)s)")
    parser.add_argument(
        "--gpus-per-node", type=int, default=1, help="GPUs sharing a node and its network link (default 1)"
    )
    _override(
        parser, "--intra-bandwidth", "GBYTE_S", "GB/s between the GPUs of a node (NVLink, PCIe; default: the network's)"
    )
    _override(parser, "--bandwidth", "GBIT_S", "link speed, overriding the preset's")
    _override(parser, "--latency-us", "LATENCY_US", "per-message latency, overriding the preset's")
    parser.add_argument(
        "--calibration", nargs="+", metavar="CSV", help="fit alpha and beta to these bench sweep CSVs instead"
    )
    parser.add_argument("--calibration-op", default="bucketed", help="the sweep op to fit (default %(default)s)")
    parser.add_argument(
        "--window-calibration",
        nargs="+",
        metavar="CSV",
        help="price the window solvers' exchanges by alpha and beta fitted to these bench windows CSVs",
    )
    parser.add_argument(
        "--window-path",
        default="internode",
        choices=("internode", "shared"),
        help="the bench windows rows to fit: internode (across nodes, default) or shared (one node)",
    )
    parser.add_argument(
        "--algorithm",
        default="auto",
        choices=ALGORITHMS,
        help="large-message allreduce; auto: the cheaper of ring and halving-doubling (default %(default)s)",
    )
    parser.add_argument(
        "--gamma", type=float, default=GPU_GAMMA, help="reduction seconds per byte (default %(default)g)"
    )
    _override(parser, "--gamma-adasum", "GAMMA_ADASUM", "Adasum's seconds per byte (default: fitted, else 3 x gamma)")
    parser.add_argument("--gemm-tflops", type=float, default=50.0, help="K-FAC factor products (default %(default)g)")
    parser.add_argument("--inverse-tflops", type=float, default=2.0, help="K-FAC inversions (default %(default)g)")
    parser.add_argument("--wire-dtype", default="float32", choices=tuple(WIRE_BYTES), help="gradient dtype on the wire")
    parser.add_argument(
        "--overlap",
        default="none",
        choices=("none", "backward"),
        help="none: every exchange after backward (an upper bound); backward: buckets sent as backward "
        "fills them (default %(default)s)",
    )
    parser.add_argument(
        "--baseline",
        type=int,
        default=1,
        metavar="P",
        help="efficiency against the iteration at P GPUs (default 1; a node's GPUs, as some papers report)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a model option for every solver that takes it (bucket_mb, tau, layout, factor_update_steps, ...)",
    )
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--csv", type=Path, help="also write the rows as CSV")


def _override(parser: argparse._ActionsContainer, flag: str, metavar: str, help: str) -> None:
    """Add ``flag``: a float that, when given, replaces what a preset, a fit or a default would say."""
    parser.add_argument(flag, type=float, metavar=metavar, help=help)


def _positive_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InputError(f"{what} must be whole numbers separated by commas, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise InputError(f"{what} must be whole numbers >= 1, got {text!r}")
    return values


def build_network(args: argparse.Namespace) -> tuple[Network, float | None]:
    """The network (and Adasum's fitted gamma, if calibrated) the arguments describe."""
    if args.gpus_per_node < 1:
        raise InputError(f"--gpus-per-node must be >= 1, got {args.gpus_per_node}")
    if args.intra_bandwidth is not None and not (math.isfinite(args.intra_bandwidth) and args.intra_bandwidth > 0):
        raise InputError(f"--intra-bandwidth must be > 0 GB/s, got {args.intra_bandwidth}")
    net, gamma_adasum = _links(args)
    intra_beta = None if args.intra_bandwidth is None else 1 / (args.intra_bandwidth * 1e9)
    return replace(net, per_node=args.gpus_per_node, intra_beta=intra_beta), gamma_adasum


def _links(args: argparse.Namespace) -> tuple[Network, float | None]:
    """The network between nodes: fitted to sweep CSVs, or a preset with --bandwidth and --latency-us."""
    if args.calibration:
        rows = read_sweep(args.calibration)
        algorithm: Algorithm = "halving-doubling" if args.algorithm == "auto" else args.algorithm
        fitted = fit_network(rows, op=args.calibration_op, algorithm=algorithm, name="calibrated")
        net = Network(alpha=fitted.alpha, beta=fitted.beta, gamma=0.0, algorithm=algorithm, name=fitted.name)
        return net, fit_adasum_gamma(rows, net)
    if args.network not in NETWORKS:
        raise InputError(f"unknown network {args.network!r} (known: {', '.join(NETWORKS)})")
    gbit_s, latency_us = NETWORKS[args.network]
    gbit_s = gbit_s if args.bandwidth is None else args.bandwidth
    latency_us = latency_us if args.latency_us is None else args.latency_us
    if not (gbit_s > 0 and latency_us >= 0):
        raise InputError(f"--bandwidth must be > 0 and --latency-us >= 0, got {gbit_s} and {latency_us}")
    if not (math.isfinite(args.gamma) and args.gamma >= 0):
        raise InputError(f"--gamma must be >= 0, got {args.gamma}")
    name = f"{gbit_s:g} Gb/s, {latency_us:g} us"
    return Network.from_link(
        gbit_s=gbit_s, latency_us=latency_us, gamma=args.gamma, algorithm=args.algorithm, name=name
    ), None


def project(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The table's rows: every solver at every rank count."""
    names = list(MODELS) if args.solver == "all" else [s.strip() for s in args.solver.split(",") if s.strip()]
    ranks = _positive_list(args.ranks, "--ranks")
    if args.batch < 1:
        raise InputError(f"--batch must be >= 1, got {args.batch}")
    given: dict[str, list[str]] = {name: [] for name in names}
    for item in args.set:
        takers = [n for n in names if item.partition("=")[0] in _option_names(n)]
        if not takers:
            raise InputError(f"--set {item!r}: no chosen solver's model takes {item.partition('=')[0]!r}")
        for name in takers:
            given[name].append(item)
    options = {
        name: model_options(name, dict(parse_model_option(name, item) for item in given[name])) for name in names
    }
    load = workload(args.model)
    if args.step_time is not None:
        step_s = args.step_time
    else:
        known = GPU_THROUGHPUT[args.gpu]
        throughput = args.throughput if args.throughput is not None else known.get(args.model)
        if throughput is None:
            raise InputError(
                f"give --throughput or --step-time for model {args.model!r} "
                f"(--gpu {args.gpu} has figures for {', '.join(known)})"
            )
        if not throughput > 0:
            raise InputError(f"--throughput must be > 0, got {throughput}")
        step_s = args.batch / throughput
    compute = Compute(
        step_s=step_s, batch=args.batch, gemm_flops=args.gemm_tflops * 1e12, inverse_flops=args.inverse_tflops * 1e12
    )
    net, fitted_gamma = build_network(args)
    window = (
        fit_window(read_window_bench(args.window_calibration), path=args.window_path)
        if args.window_calibration
        else None
    )
    gamma_adasum = (
        args.gamma_adasum
        if args.gamma_adasum is not None
        else (fitted_gamma if fitted_gamma is not None else 3 * net.gamma)
    )
    if args.baseline < 1:
        raise InputError(f"--baseline must be >= 1 GPU, got {args.baseline}")

    def case(p: int) -> Case:
        return Case(
            load, net, compute, p, WIRE_BYTES[args.wire_dtype], gamma_adasum, window, args.overlap == "backward"
        )

    rows = []
    for name in names:
        single = iteration(name, case(args.baseline), options[name])
        for p in ranks:
            it = iteration(name, case(p), options[name])
            rows.append(
                {
                    "solver": name,
                    "model": args.model,
                    "ranks": p,
                    "iteration_ms": it.total * 1e3,
                    "compute_ms": it.compute * 1e3,
                    "comm_ms": it.comm * 1e3,
                    "exposed_ms": it.exposed * 1e3,
                    "efficiency": single.total / it.total,
                    "samples_per_s": p * args.batch / it.total,
                }
            )
    return rows


def _option_names(solver: str) -> set[str]:
    if solver not in MODELS:
        raise InputError(f"no performance model for solver {solver!r} (modelled: {', '.join(MODELS)})")
    return set(option_fields(MODELS[solver][1]))


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'solver':<13} {'model':<12} {'ranks':>6} {'iter ms':>9} {'compute':>9} {'comm':>9} {'exposed':>9} "
        f"{'eff':>6} {'samples/s':>11}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['solver']:<13} {r['model']:<12} {r['ranks']:>6} {r['iteration_ms']:>9.2f} {r['compute_ms']:>9.2f} "
            f"{r['comm_ms']:>9.2f} {r['exposed_ms']:>9.2f} {r['efficiency']:>6.1%} {r['samples_per_s']:>11.0f}"
        )
    return "\n".join(lines)


def write_rows(rows: list[dict[str, Any]], *, json_path: Path | None, csv_path: Path | None) -> None:
    for path in (json_path, csv_path):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
    if json_path is not None:
        json_path.write_text(json.dumps(rows, indent=1) + "\n")
    if csv_path is not None:
        with csv_path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)


def run(args: argparse.Namespace) -> int:
    rows = project(args)
    net, _ = build_network(args)
    print(
        f"# {args.model}, batch {args.batch}/GPU, network {net.name}: alpha {net.alpha * 1e6:.3g} us, "
        f"beta {net.beta * 1e9:.4g} ns/B ({8 / max(net.beta, 1e-30) / 1e9:.3g} Gb/s), {net.algorithm} allreduce, "
        f"{args.gpus_per_node} GPU(s) a node, overlap {args.overlap}"
    )
    print(table(rows))
    try:
        write_rows(rows, json_path=args.json, csv_path=args.csv)
    except OSError as err:
        raise InputError(f"cannot write the table: {err}") from None
    return 0
