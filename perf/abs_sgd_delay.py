"""What a one-update delay costs momentum SGD, and what weight prediction gives back (one process).

Write-up, figures and provenance: docs/studies/abs-sgd.md.

The MLP on digits trained by plain SGD on batches of ``--batch`` samples, where update k
applies the gradient computed one update earlier (ABS-SGD's delay), optionally at the
predicted weights ``w + c (w - w_before_last_update)`` (``abs-sgd``'s ``weight_prediction``),
or with DC-ASGD's compensation ``g + lambda g * g * (w - w_before_last_update)``, against the
same SGD without delay. Prints, per setting, the updates each seed needed to
reach ``--target`` test accuracy (evaluated every 5 updates; None: not within ``--max-updates``).
Counts only, no timing: ``python perf/abs_sgd_delay.py``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from mpisolve.train.data import load_dataset
from mpisolve.train.models import build_model

SETTINGS = (  # (delay, momentum, lr, weight prediction c, DC-ASGD lambda)
    (0, 0.9, 0.02, 0.0, 0.0),
    (1, 0.9, 0.02, 0.0, 0.0),
    (1, 0.9, 0.02, 1.0, 0.0),
    (1, 0.9, 0.02, 2.0, 0.0),
    (1, 0.8, 0.04, 0.0, 0.0),
    (1, 0.9, 0.02, 0.0, 0.5),
    (1, 0.9, 0.02, 0.0, 2.0),
)


def updates_to_target(
    data,
    *,
    delay: int,
    momentum: float,
    lr: float,
    c: float,
    dc: float,
    batch: int,
    target: float,
    max_updates: int,
    seed: int,
) -> int | None:
    torch.manual_seed(seed)
    model = build_model("mlp", data.in_shape, data.classes)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum)
    draw = torch.Generator().manual_seed(seed + 1)
    pending: list[list[torch.Tensor]] = []
    before = [p.detach().clone() for p in params]  # the weights before the last update
    for update in range(1, max_updates + 1):
        index = torch.randint(0, len(data.train), (batch,), generator=draw)
        true = [p.detach().clone() for p in params]
        with torch.no_grad():  # compute at the predicted weights
            for p, b in zip(params, before):
                p.add_(c * (p - b))
        model.zero_grad()
        F.cross_entropy(model(data.train.x[index]), data.train.y[index]).backward()
        pending.append([p.grad.clone() for p in params])
        with torch.no_grad():
            for p, t in zip(params, true):
                p.copy_(t)
        if len(pending) > delay:
            grads = pending.pop(0)
            for p, g, b in zip(params, grads, before):
                p.grad = g + dc * g * g * (p.detach() - b) if dc else g
            before = [p.detach().clone() for p in params]
            optimizer.step()
        if update % 5 == 0:
            with torch.no_grad():
                accuracy = (model(data.test.x).argmax(1) == data.test.y).float().mean().item()
            if accuracy >= target:
                return update
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-updates", type=int, default=600)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = load_dataset("digits")
    print(f"MLP on digits, batch {args.batch}: updates to {args.target} test accuracy, seeds 0..{args.seeds - 1}")
    for delay, momentum, lr, c, dc in SETTINGS:
        counts = [
            updates_to_target(
                data,
                delay=delay,
                momentum=momentum,
                lr=lr,
                c=c,
                dc=dc,
                batch=args.batch,
                target=args.target,
                max_updates=args.max_updates,
                seed=seed,
            )
            for seed in range(args.seeds)
        ]
        print(
            f"delay {delay}, momentum {momentum}, lr {lr}, weight prediction {c}, DC lambda {dc}: {counts}", flush=True
        )


if __name__ == "__main__":
    main()
