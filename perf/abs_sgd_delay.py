"""What ABS-SGD's one-round delay costs momentum SGD, and what each correction gives back (one process).

The MLP on digits trained as ABS-SGD's rounds train it, without MPI and without timing:
each round draws ``k`` times the global batch ``--batch`` (k from the setting's round
sizes: 1 when rounds are bounded, 2 or 3 when they last several micro-batches), computes
its mean gradient at the weights predicted for when it is applied, ``w + c (w -
w_before_last_update)``, and update t applies round t - delay through torch's SGD with
the setting's learning rate and momentum: as given, corrected by ``momentum_correction``'s
rule (:func:`mpisolve.solvers.abs_sgd.corrected_momentum`, the solver's own), and/or
scaled with the round's batch (batch-proportional learning rate). Synchronous SGD is
delay 0 with rounds of one batch. Test accuracy is evaluated every quarter epoch; the
script prints, per setting, the epochs each seed needed to reach ``--target`` (None: not
within ``--epochs``) and appends them to ``--csv``. Counts only, no timing:
``python perf/abs_sgd_delay.py --batch 128 --lr 0.05``. Write-up: docs/studies/abs-sgd.md.

``--stability`` prints instead, for heavy ball with momentum b whose gradient is one update
late and taken at the prediction with coefficient c, the largest stable ``lr x curvature``
on a quadratic, in units of ``1 - b`` (so that it compares step sizes ``lr / (1 - b)``): the
largest root of ``z^3 - (1 + b) z^2 + (b + a (1 + c)) z - a c`` stays inside the unit circle
for ``a = lr x curvature`` below it.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mpisolve.solvers.abs_sgd import corrected_momentum
from mpisolve.train.data import load_dataset
from mpisolve.train.models import build_model


@dataclass(frozen=True)
class Setting:
    name: str
    delay: int = 1
    prediction: float = 0.0
    momentum_correction: bool = False
    batch_proportional_lr: bool = False
    round_sizes: tuple[int, ...] = (1,)  # rounds of k global batches, k drawn from these


SETTINGS = (
    Setting("synchronous SGD", delay=0),
    Setting("delay 1 (the rule as written)"),
    Setting("delay 1, prediction c=1", prediction=1.0),
    Setting("delay 1, momentum correction", momentum_correction=True),
    Setting("delay 1, c=1, momentum correction", prediction=1.0, momentum_correction=True),
    Setting("delay 1, c=1.5, momentum correction", prediction=1.5, momentum_correction=True),
    Setting("delay 1, c=2, momentum correction", prediction=2.0, momentum_correction=True),
    Setting("rounds of 2-3 batches, no delay", delay=0, round_sizes=(2, 3)),
    Setting(
        "rounds of 2-3 batches, no delay, batch-proportional lr",
        delay=0,
        batch_proportional_lr=True,
        round_sizes=(2, 3),
    ),
    Setting("rounds of 2-3 batches, c=1", prediction=1.0, round_sizes=(2, 3)),
    Setting(
        "rounds of 2-3 batches, c=1.5, momentum correction",
        prediction=1.5,
        momentum_correction=True,
        round_sizes=(2, 3),
    ),
    Setting(
        "rounds of 2-3 batches, c=1.5, momentum correction, batch-proportional lr",
        prediction=1.5,
        momentum_correction=True,
        batch_proportional_lr=True,
        round_sizes=(2, 3),
    ),
)


def epochs_to_target(
    data, setting: Setting, *, batch: int, lr: float, momentum: float, target: float, epochs: float, seed: int
) -> float | None:
    torch.manual_seed(seed)
    model = build_model("mlp", data.in_shape, data.classes)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum)
    draw = torch.Generator().manual_seed(seed + 1)
    order, at = torch.randperm(len(data.train), generator=draw), 0
    before = [p.detach().clone() for p in params]  # the weights before the last update
    pending: list[tuple[list[torch.Tensor], int]] = []
    seen, evaluate_at = 0, 0.25
    while seen < epochs * len(data.train):
        k = setting.round_sizes[int(torch.randint(len(setting.round_sizes), (1,), generator=draw))]
        parts = []
        for _ in range(k * batch):  # the next k * batch samples of the shuffled epochs
            if at == len(order):
                order, at = torch.randperm(len(data.train), generator=draw), 0
            parts.append(order[at])
            at += 1
        index = torch.stack(parts)
        true = [p.detach().clone() for p in params]
        with torch.no_grad():  # this round computes at the predicted weights
            for p, b in zip(params, before):
                p.add_(setting.prediction * (p - b))
        model.zero_grad()
        F.cross_entropy(model(data.train.x[index]), data.train.y[index]).backward()
        pending.append(([p.grad.clone() for p in params], k))
        with torch.no_grad():
            for p, t in zip(params, true):
                p.copy_(t)
        seen += k * batch
        if len(pending) > setting.delay:
            grads, ratio = pending.pop(0)
            group = optimizer.param_groups[0]
            group["lr"], group["momentum"] = lr * (ratio if setting.batch_proportional_lr else 1.0), momentum
            if setting.momentum_correction:
                group["momentum"] = corrected_momentum(momentum, ratio)
                group["lr"] *= (1 - group["momentum"]) / (1 - momentum)
            for p, g in zip(params, grads):
                p.grad = g
            before = [p.detach().clone() for p in params]
            optimizer.step()
        while seen >= evaluate_at * len(data.train):
            evaluate_at += 0.25
            with torch.no_grad():
                accuracy = (model(data.test.x).argmax(1) == data.test.y).float().mean().item()
            if accuracy >= target:
                return evaluate_at - 0.25
    return None


def largest_stable_step(momentum: float, prediction: float) -> float:
    """The largest ``lr x curvature`` (over ``1 - momentum``) for which the delayed heavy ball converges."""

    def stable(a: float) -> bool:
        roots = np.roots([1.0, -(1.0 + momentum), momentum + a * (1.0 + prediction), -a * prediction])
        return bool(np.max(np.abs(roots)) < 1.0)

    low, high = 0.0, 1e-3
    while stable(high):
        low, high = high, 2 * high
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if stable(middle) else (low, middle)
    return low / (1.0 - momentum)


def stability_table() -> None:
    predictions = (0.0, 0.5, 1.0, 1.25, 1.5, 1.75, 2.0)
    print("momentum | " + " | ".join(f"c={c:g}" for c in predictions))
    for momentum in (0.8, 8 / 9, 0.9, 0.95):
        row = [f"{largest_stable_step(momentum, c):.2f}" for c in predictions]
        print(f"{momentum:.3f} | " + " | ".join(row))
    print("without the delay: lr x curvature / (1 - b) < 2 (1 + b) / (1 - b), 38 at b = 0.9")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128, help="synchronous SGD's global batch")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--epochs", type=float, default=5.0)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--csv", type=Path, default=Path("perf/results/abs_sgd_delay/delay.csv"))
    parser.add_argument("--stability", action="store_true", help="print the quadratic's stability table and stop")
    args = parser.parse_args()
    if args.stability:
        stability_table()
        return
    torch.set_num_threads(1)
    data = load_dataset("digits")
    print(f"MLP on digits, global batch {args.batch}, lr {args.lr}, momentum {args.momentum}: epochs to {args.target}")
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    new = not args.csv.exists()
    with args.csv.open("a", newline="") as f:
        writer = csv.writer(f)
        if new:
            writer.writerow(["batch", "lr", "momentum", "setting", "seed", "epochs_to_target"])
        for setting in SETTINGS:
            counts = [
                epochs_to_target(
                    data,
                    setting,
                    batch=args.batch,
                    lr=args.lr,
                    momentum=args.momentum,
                    target=args.target,
                    epochs=args.epochs,
                    seed=seed,
                )
                for seed in range(args.seeds)
            ]
            for seed, count in enumerate(counts):
                writer.writerow(
                    [args.batch, args.lr, args.momentum, setting.name, seed, "" if count is None else count]
                )
            f.flush()
            median = statistics.median(math.inf if c is None else c for c in counts)
            print(f"{setting.name}: {counts} (median {median})", flush=True)


if __name__ == "__main__":
    main()
