"""Gradient accumulation, clipping and mixed precision with mpisolve.

Run: mpiexec -n 2 python -m mpi4py examples/accumulate_clip_amp.py [--solver allreduce]

Each step takes --micro micro-batches: every backward but the last runs inside
``solver.no_sync()`` (the gradients only accumulate), each micro-batch's loss divided by
their number so that the step averages over all of them, as with DDP. The forward passes
run under ``torch.autocast`` (bfloat16 on the CPU; float16 on a GPU, where the
GradScaler matters); ``solver.synchronize(scaler=...)`` completes the gradients'
reduction and unscales them, so that ``clip_grad_norm_`` sees the true averaged gradients;
``solver.step(scaler=...)`` applies them, or skips the step on every rank alike when the
scaler found an Inf or NaN (``info.applied`` is then False); ``scaler.update()`` follows.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
from torch import nn

import mpisolve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    # K-FAC refuses no_sync(): its factors come from one forward and backward per step.
    solvers = [name for name in mpisolve.solver_names() if name != "kfac"]
    parser.add_argument("--solver", default="allreduce", choices=solvers)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--max-norm", type=float, default=1.0)
    args = parser.parse_args()

    comm = mpisolve.init()
    device = comm.device
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler(device.type)
    target = torch.randn(16, generator=torch.Generator().manual_seed(1))
    data = torch.Generator().manual_seed(100 + comm.rank)  # each rank its own samples

    with mpisolve.make_solver(args.solver, model, optimizer) as solver:
        for step in range(args.steps):
            solver.zero_grad()
            for i in range(args.micro):
                x = torch.randn(args.micro_batch, 16, generator=data)
                y = (x @ target).tanh().unsqueeze(1)
                last = i == args.micro - 1
                with solver.no_sync() if not last else nullcontext():
                    with torch.autocast(device.type, dtype=amp_dtype):
                        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device)) / args.micro
                    scaler.scale(loss).backward()
            solver.synchronize(scaler=scaler)  # reduced and unscaled: p.grad is what step applies
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
            info = solver.step(scaler=scaler)
            scaler.update()
            if comm.rank == 0 and step % 10 == 0:
                print(f"step {step} loss {loss.item() * args.micro:.4f} grad norm {norm:.3f} applied {info.applied}")
        if comm.rank == 0:
            print(f"final loss {loss.item() * args.micro:.4f} scale {scaler.get_scale():g}", flush=True)


if __name__ == "__main__":
    main()
