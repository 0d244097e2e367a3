"""Where the one-rank finite check's time goes in a step: the MLP of ``bench step --model mlp --batch 32``.

``python -m perf.gpu.finite_check_cost [--repeats N]`` (one process, the CPU) times, in turn
within each repeat, plain PyTorch's step (zero_grad, forward, backward, SGD with momentum)
and the same step with, between backward and the optimizer's step:

- ``probe``: :func:`mpisolve.comm.readback.finite_probe` of the gradients, read (the check a
  one-rank solver takes);
- ``probe_twice``: that, then a second one (what a pass costs once the first has run);
- ``hooks``: each gradient summed by a post-accumulate-grad hook as backward writes it (with
  the pool of OpenMP threads awake and the gradient just written), the sums added at the step;

and, within the plain step, each gradient's sum taken right after backward and again at once
(``first_pass_us``, ``second_pass_us``): what a first read of fresh gradients costs over a
second. Prints one JSON line (medians, microseconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from mpisolve.comm.readback import finite_probe
from mpisolve.train.models import mlp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))

    def model() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = mlp((1, 8, 8), 10)
        return net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    def grads(net: nn.Module) -> list[torch.Tensor]:
        return [g for p in net.parameters() if (g := p.grad) is not None]

    models = {name: model() for name in ("plain", "probe", "probe_twice", "hooks")}
    sums: list[torch.Tensor] = []

    def hook(p: torch.Tensor) -> None:
        assert p.grad is not None  # a post-accumulate-grad hook runs once the gradient is written
        sums.append(p.grad.sum())

    for p in models["hooks"][0].parameters():
        p.register_post_accumulate_grad_hook(hook)
    checks: dict[str, Callable[[nn.Module], None]] = {
        "plain": lambda net: None,
        "probe": lambda net: finite_probe(grads(net)).item(),
        "probe_twice": lambda net: (finite_probe(grads(net)).item(), finite_probe(grads(net)).item()),
        "hooks": lambda net: torch.stack(sums).sum().item(),
    }
    times: dict[str, list[float]] = {name: [] for name in checks}
    first: list[list[float]] = []
    second: list[list[float]] = []
    for repeat in range(args.repeats + args.warmup):
        for name, check in checks.items():
            net, optimizer = models[name]
            sums.clear()
            start = time.perf_counter()
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            check(net)
            if name == "plain" and repeat >= args.warmup:  # outside the timed step: its own figures
                taken = time.perf_counter()
                passes = []
                for _ in range(2):
                    row = []
                    for g in grads(net):
                        t0 = time.perf_counter()
                        g.sum()
                        row.append(time.perf_counter() - t0)
                    passes.append(row)
                first.append(passes[0])
                second.append(passes[1])
                start += time.perf_counter() - taken
            optimizer.step()
            if repeat >= args.warmup:
                times[name].append(time.perf_counter() - start)
    plain = statistics.median(times["plain"])
    result = {
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "numels": [g.numel() for g in grads(models["plain"][0])],
        **{f"{name}_us": round(statistics.median(t) * 1e6, 1) for name, t in times.items()},
        **{f"{name}_over_plain": round(statistics.median(t) / plain, 4) for name, t in times.items()},
        "first_pass_us": [round(statistics.median(c) * 1e6, 1) for c in zip(*first)],
        "second_pass_us": [round(statistics.median(c) * 1e6, 1) for c in zip(*second)],
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
