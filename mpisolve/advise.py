"""``python -m mpi4py -m mpisolve advise``: which solver suits this model on this cluster, and why.

Under ``mpiexec``, every rank at once measures, for ``--model`` on micro-batches of
``--batch-size`` from ``--dataset`` (the same forms as ``train``'s: built-in names,
``torchvision:NAME``, ``MODULE:FACTORY``, ``cifar10:PATH``, ``imagefolder:PATH``):

- ``compute_s``: one training step of a rank alone (forward, backward, an SGD step
  with momentum), all ranks computing at the same time, as they do in training; or,
  with ``--device-ms MS``, an emulated device's step, batch x MS ms (the study's);
- ``allreduce_s``: the ``allreduce`` solver's averaging of the model's gradients (its
  fused buckets, as in a training step; the ``bench allreduce`` code);

both medians over ``--repeats`` (each repeat timed by its slowest rank), and their
ratio ``compute_s / allreduce_s``. Where communication dominates (a low ratio), ``ea-wild``,
which never waits for the others, reaches a target sooner than ``allreduce``; where
computation dominates, ``allreduce`` does, as the EA-wild paper found. So a ratio below
:data:`EA_WILD_BELOW` (set by the study ``perf/easgd.sh``: docs/studies/easgd-async.md)
recommends ``ea-wild``, any higher ``allreduce``. ``--threshold`` replaces it (a study of your own cluster). Rank 0
prints the figures, the rule and the recommendation (``--json``: one JSON object).
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .errors import InputError

if TYPE_CHECKING:
    from .comm.communicator import Communicator

#: Below this computation/communication ratio, recommend ea-wild: it lies between the ratios
#: of the study's two workloads, ea-wild ahead on the lower and allreduce on the higher (their
#: ratios and times to target: docs/studies/easgd-async.md, perf/results/easgd/*/advise.json).
EA_WILD_BELOW = 3.0
#: Where the rule and the study's ratios are written up, for the printed reason.
STUDY = "docs/studies/easgd-async.md"


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
        default=EA_WILD_BELOW,
        help=f"recommend ea-wild below this ratio (default {EA_WILD_BELOW:g}, the study's)",
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
    if not args.threshold >= 0:
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
    """Measure on every rank of ``comm``; the figures, the rule and the recommendation."""
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
    allreduce_s, _, _ = solver_allreduce_seconds(params, comm, int(args.bucket_mb * 1e6), args.repeats, args.warmup)
    ratio = compute_s / allreduce_s
    solver = "ea-wild" if ratio < args.threshold else "allreduce"
    return {
        "model": args.model,
        "dataset": args.dataset,
        "batch_size": args.batch_size,
        "ranks": comm.size,
        "parameters": sum(p.numel() for p in params),
        "compute_s": compute_s,
        "device_ms": args.device_ms,
        "allreduce_s": allreduce_s,
        "ratio": ratio,
        "threshold": args.threshold,
        "recommendation": solver,
    }


def explain(result: dict[str, Any]) -> str:
    """The figures, the rule and the recommendation, as lines of text."""
    ratio, threshold = result["ratio"], result["threshold"]
    side = "below" if ratio < threshold else "at or above"
    return "\n".join(
        [
            f"{result['model']} on {result['dataset']}, batch {result['batch_size']} per rank, {result['ranks']} ranks,"
            f" {result['parameters']:,} parameters",
            f"computation: {result['compute_s'] * 1e3:.2f} ms per step "
            + (
                "(forward, backward, SGD step; all ranks at once)"
                if result["device_ms"] is None
                else f"(an emulated device: {result['batch_size']} samples x {result['device_ms']:g} ms)"
            ),
            f"communication: {result['allreduce_s'] * 1e3:.2f} ms per gradient allreduce "
            "(the allreduce solver's buckets)",
            f"computation/communication ratio: {ratio:.3f}",
            f"rule: ratio < {threshold:g} -> ea-wild, else allreduce"
            f" (default {EA_WILD_BELOW:g}: between the ratios of the study's two workloads, {STUDY})",
            f"recommendation: {result['recommendation']} (the ratio is {side} {threshold:g})",
        ]
    )
