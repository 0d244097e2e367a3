"""Fault injection for reliability tests: make one rank fail on purpose, mid-training.

``MPISOLVE_FAULT=RANK:STEP:KIND`` makes rank ``RANK`` fail in the forward pass of its
``STEP``-th training micro-batch (counted from 1 in this process), where ``KIND`` is

- ``raise``: an exception (the job must end: ``python -m mpi4py`` aborts it);
- ``kill``: SIGKILL to its own process (no Python, no MPI clean-up);
- ``stall``: sleep for an hour, as a hung rank would (the others' watchdog must fire).

Unset (the normal case), nothing is installed: the training step runs no extra code.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from ..errors import InputError

ENV = "MPISOLVE_FAULT"
KINDS = ("raise", "kill", "stall")


class InjectedFault(RuntimeError):
    """The exception ``MPISOLVE_FAULT=...:raise`` raises."""


def parse(spec: str) -> tuple[int, int, str]:
    """``"RANK:STEP:KIND"`` -> (rank, step, kind), or :class:`InputError` naming the problem."""
    parts = spec.split(":")
    try:
        if len(parts) != 3:
            raise ValueError(spec)
        rank, step, kind = int(parts[0]), int(parts[1]), parts[2]
    except ValueError:
        raise InputError(f"{ENV} must be RANK:STEP:KIND, got {spec!r}") from None
    if rank < 0 or step < 1 or kind not in KINDS:
        raise InputError(f"{ENV}={spec!r}: need RANK >= 0, STEP >= 1 and KIND one of {', '.join(KINDS)}")
    return rank, step, kind


def install(model: torch.nn.Module, rank: int) -> None:
    """Arm the fault ``MPISOLVE_FAULT`` describes on ``model`` if it targets ``rank`` (else nothing)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    target, step, kind = parse(spec)
    if rank != target:
        return
    seen = 0

    def fail(module: torch.nn.Module, args: tuple) -> None:
        nonlocal seen
        if not torch.is_grad_enabled():  # evaluation passes do not count
            return
        seen += 1
        if seen < step:
            return
        sys.stderr.write(f"{ENV}: rank {rank} fails ({kind}) at training step {step}\n")
        sys.stderr.flush()
        if kind == "raise":
            raise InjectedFault(f"{ENV}: rank {rank} fails at training step {step}")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)

    model.register_forward_pre_hook(fail)
