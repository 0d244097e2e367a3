"""``python -m mpi4py -m mpisolve advise``: which solver suits this model on this cluster, and why.

Under ``mpiexec``, every rank at once measures, for ``--model`` on micro-batches of
``--batch-size`` from ``--dataset`` (the same forms as ``train``'s: built-in names,
``torchvision:NAME``, ``MODULE:FACTORY``, ``cifar10:PATH``, ``imagefolder:PATH``):

- ``compute_s``: one training step of a rank alone (forward, backward, an SGD step
  with momentum), all ranks computing at the same time, as they do in training; or,
  with ``--device-ms MS``, an emulated device's step, batch x MS ms (the study's);
- ``allreduce_s``: the ``allreduce`` solver's averaging of the model's gradients (its
  fused buckets, as in a training step; the ``bench allreduce`` code), and
  ``latency_s``, the same path's averaging of one 4 KiB tensor;

all medians over ``--repeats`` (each repeat timed by its slowest rank), and the ratio
``compute_s / allreduce_s``. The measured evidence is the EASGD study's
(docs/studies/easgd-async.md; its figures, package data ``studies.json``, come from
``perf/advise_studies.py``): at 4 ranks, each rank on an emulated device, ``ea-wild``
reached the target sooner than ``allreduce`` on the workload of the lower ratio (the
MLP, communication-bound) and later on the higher one (the CNN, compute-bound), as the
EA-wild paper found on GPU clusters. The recommendation is the winner of the study's
workload whose ratio is nearest this one's (on a log scale: below the geometric mean of
the two ratios, ``ea-wild``); ``--threshold`` replaces that boundary (a study of your own
cluster). The performance model (:mod:`.perfmodel`) then prices both solvers' iterations
on these figures: the network's alpha and beta fitted to the two measured allreduces,
the step as measured, ``ea-wild`` exchanging every 4 steps. Rank 0 prints the figures,
the measured figure and the model figure the recommendation rests on (``--json``: one
JSON object).
"""

from __future__ import annotations

import argparse
import json
import math
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .errors import InputError

if TYPE_CHECKING:
    from .comm.communicator import Communicator

#: The study's measured points (written by perf/advise_studies.py).
STUDIES = Path(__file__).with_name("studies.json")
#: The solvers the study compared; the recommendation is one of them.
CANDIDATES = ("allreduce", "ea-wild")
#: Bytes of the small allreduce that fixes the network's per-message latency.
LATENCY_BYTES = 4096


@cache
def studies() -> dict[str, Any]:
    """The study's points: workload, ratio, target, seeds, median times to target, winner."""
    loaded: dict[str, Any] = json.loads(STUDIES.read_text())
    return loaded


def boundary() -> float:
    """The ratio between the study's two workloads (their geometric mean): below it the
    lower ratio's workload is the nearer, on a log scale."""
    low, high = sorted(point["ratio"] for point in studies()["points"])
    return math.sqrt(low * high)


def nearest(ratio: float, threshold: float) -> dict[str, Any]:
    """The study's point on ``ratio``'s side of ``threshold``."""
    low, high = sorted(studies()["points"], key=lambda point: point["ratio"])
    return low if ratio < threshold else high


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .train.data import DATASET_FORMS, DEFAULT_IMAGE_SIZE
    from .train.models import MODEL_FORMS

    parser.add_argument(
        "--model", metavar="SPEC", default="mlp", help=f"the model: {MODEL_FORMS} (default mlp; as train's)"
    )
    parser.add_argument(
        "--dataset", metavar="SPEC", default="digits", help=f"the data set: {DATASET_FORMS} (default digits)"
    )
    parser.add_argument(
        "--image-size",
        type=int,
        metavar="S",
        help=f"imagefolder: the side images are resized and cropped to (default {DEFAULT_IMAGE_SIZE})",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="each worker's micro-batch (default 32)")
    parser.add_argument(
        "--device-ms",
        type=float,
        metavar="MS",
        help="take a step's computation as the emulated device's batch x MS ms (train --device-ms) "
        "instead of measuring it",
    )
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="the allreduce solver's bucket size (default 25)")
    parser.add_argument(
        "--repeats", type=int, default=20, help="timed repeats of each measurement (the median is used)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed repeats first")
    parser.add_argument(
        "--threshold",
        type=float,
        help=f"recommend ea-wild below this ratio (default: between the study's two workloads, {boundary():.3g})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def check(args: argparse.Namespace) -> None:
    """Raise :class:`InputError` naming the first bad argument (the model and data set are not loaded yet)."""
    from .train.data import parse_dataset
    from .train.models import check_model_spec

    check_model_spec(args.model)
    kind, _ = parse_dataset(args.dataset)
    if args.image_size is not None and (args.image_size < 1 or kind != "imagefolder"):
        raise InputError(f"--image-size must be >= 1 and applies to imagefolder data sets, got {args.image_size}")
    if args.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.device_ms is not None and not args.device_ms > 0:
        raise InputError(f"--device-ms must be > 0, got {args.device_ms}")
    if not args.bucket_mb > 0:
        raise InputError(f"--bucket-mb must be > 0, got {args.bucket_mb}")
    if args.repeats < 1 or args.warmup < 0:
        raise InputError(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    if args.threshold is not None and not args.threshold >= 0:
        raise InputError(f"--threshold must be >= 0, got {args.threshold}")


def run(args: argparse.Namespace) -> int:
    from .comm import init

    comm = init()
    comm.agree(lambda: check(args))
    result = advise(args, comm)
    if comm.rank == 0:
        print(json.dumps(result) if args.json else explain(result), flush=True)
    return 0


def advise(args: argparse.Namespace, comm: Communicator) -> dict[str, Any]:
    """Measure on every rank of ``comm``; the figures, the evidence, the model and the recommendation."""
    from .bench import median_seconds
    from .bench.allreduce import solver_allreduce_seconds
    from .train.data import load_dataset, seed_everything
    from .train.models import model_for

    seed_everything(0)  # a data set factory that draws random numbers draws the same on every rank
    data = comm.agree(lambda: load_dataset(args.dataset, image_size=args.image_size))
    model = comm.agree(lambda: model_for(args.model, data, seed=0))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    picks = torch.arange(comm.rank * args.batch_size, (comm.rank + 1) * args.batch_size) % len(data.train)
    x, y = comm.agree(lambda: data.train.take(picks))

    def compute() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    if args.device_ms is None:
        compute_s = median_seconds(compute, comm, args.repeats, args.warmup)
    else:  # the study's emulated device: a micro-batch of n samples takes n x MS ms
        compute_s = args.batch_size * args.device_ms / 1e3
    params = list(model.parameters())
    bucket_bytes = int(args.bucket_mb * 1e6)
    allreduce_s, _, _ = solver_allreduce_seconds(params, comm, bucket_bytes, args.repeats, args.warmup)
    small = [torch.nn.Parameter(torch.zeros(LATENCY_BYTES // 4))]
    latency_s, _, _ = solver_allreduce_seconds(small, comm, bucket_bytes, args.repeats, args.warmup)
    ratio = compute_s / allreduce_s
    threshold = boundary() if args.threshold is None else args.threshold
    evidence = nearest(ratio, threshold)
    figures = {
        "model": args.model,
        "dataset": args.dataset,
        "batch_size": args.batch_size,
        "ranks": comm.size,
        "parameters": sum(p.numel() for p in params),
        "compute_s": compute_s,
        "device_ms": args.device_ms,
        "allreduce_s": allreduce_s,
        "latency_s": latency_s,
        "ratio": ratio,
        "threshold": threshold,
    }
    modelled = model_figures(figures, model, x[:1])
    return {**figures, **modelled, "measured": evidence, "recommendation": evidence["winner"]}


def model_figures(figures: dict[str, Any], model: torch.nn.Module, example: torch.Tensor) -> dict[str, Any]:
    """The performance model's iterations of the candidates on the measured figures: the
    network fitted to the two allreduces, the measured step as the compute."""
    from .perfmodel.calibrate import fit_network
    from .perfmodel.iteration import Case, Compute, iteration
    from .perfmodel.workloads import of_module

    load = of_module(model, example, figures["model"])
    p = figures["ranks"]
    rows = [
        {"ranks": p, "op": "bucketed", "bytes": float(LATENCY_BYTES), "seconds": figures["latency_s"]},
        {"ranks": p, "op": "bucketed", "bytes": float(load.params * 4), "seconds": figures["allreduce_s"]},
    ]
    net = fit_network(rows, op="bucketed", algorithm="halving-doubling", name="this cluster")
    case = Case(load, net, Compute(step_s=figures["compute_s"], batch=figures["batch_size"]), p, 4, 0.0)
    iterations = {solver: iteration(solver, case) for solver in CANDIDATES}
    return {
        "alpha_s": net.alpha,
        "beta_s_per_byte": net.beta,
        "modelled_iteration_s": {solver: it.total for solver, it in iterations.items()},
        "modelled_exposed_s": {solver: it.exposed for solver, it in iterations.items()},
    }


def explain(result: dict[str, Any]) -> str:
    """The figures, the evidence, the model figure and the recommendation, as lines of text."""
    ratio, threshold, point = result["ratio"], result["threshold"], result["measured"]
    times = point["median_time_to_target_s"]
    modelled, exposed = result["modelled_iteration_s"], result["modelled_exposed_s"]
    other = next(s for s in CANDIDATES if s != point["winner"])
    return "\n".join(
        [
            f"{result['model']} on {result['dataset']}, batch {result['batch_size']} per rank, {result['ranks']} ranks,"
            f" {result['parameters']:,} parameters",
            f"computation: {result['compute_s'] * 1e3:.4g} ms per step "
            + (
                "(forward, backward, SGD step; all ranks at once)"
                if result["device_ms"] is None
                else f"(an emulated device: {result['batch_size']} samples x {result['device_ms']:g} ms)"
            ),
            f"communication: {result['allreduce_s'] * 1e3:.4g} ms per gradient allreduce "
            f"(the allreduce solver's buckets), {result['latency_s'] * 1e6:.0f} us for {LATENCY_BYTES} bytes",
            f"computation/communication ratio: {ratio:.3f}",
            f"rule: the winner of the study's workload nearest this ratio (log scale): ratio < {threshold:.3g}"
            f" -> ea-wild, else allreduce ({studies()['study']})",
            f"measured: {point['workload']}, ratio {point['ratio']:.3g}: {point['winner']} reached"
            f" {point['target_accuracy']:g} accuracy in {times[point['winner']]:.2f} s against {times[other]:.2f} s"
            f" for {other} (median over seeds {', '.join(map(str, point['seeds']))})",
            f"model: alpha {result['alpha_s'] * 1e6:.1f} us, beta {result['beta_s_per_byte'] * 1e9:.3f} ns/B fitted"
            " to the two allreduces; an iteration "
            + ", ".join(
                f"{s} {modelled[s] * 1e3:.2f} ms ({exposed[s] * 1e3:.2f} of it communication)" for s in CANDIDATES
            )
            + f": {point['winner']} runs {modelled[other] / modelled[point['winner']]:.2f}x"
            f" {other}'s iterations a second",
            f"recommendation: {result['recommendation']} (the ratio is "
            + ("below" if ratio < threshold else "at or above")
            + f" {threshold:.3g}: nearest the study's {point['workload'].split(',')[0]})",
        ]
    )
