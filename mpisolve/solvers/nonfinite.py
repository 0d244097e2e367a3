"""Non-finite values (NaN, Inf) never reach the model silently: check, then skip or stop.

Every solver takes the option ``nonfinite`` (see :class:`~mpisolve.solvers.base.CommonOptions`):

- ``"raise"`` (default): a step whose gradients or update hold a NaN or an Inf raises
  :class:`NonFiniteError` (the job stops, naming what was not finite and the step);
- ``"skip"``: the step is skipped (no update; counted in :attr:`NonFiniteGuard.skipped`,
  which the trainer logs as ``skipped_steps``). After :data:`MAX_CONSECUTIVE_SKIPS`
  skipped steps in a row it raises :class:`NonFiniteError` all the same: the model has
  diverged (finite weights whose every gradient overflows), and skipping on would spin
  forever, since a skipped step leaves the model, and so the next gradient, as it was;
- ``"ignore"``: no check at all (nothing computed).

A solver calls :meth:`NonFiniteGuard.ok` on what it is about to apply. Where that is the
result of a reduction (allreduce, Adasum), every rank holds the same values, so every rank
decides alike with no communication (a NaN on one rank makes the sum NaN everywhere).
Where ranks hold different values but must decide alike (a local step before a
collective), :meth:`NonFiniteGuard.agreed` adds one 1-element allreduce and
:meth:`NonFiniteGuard.decide` applies the policy to its answer. Asynchronous solvers check
their own update and skip it alone: nothing non-finite then reaches the shared vector.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

from ..comm.communicator import Communicator
from ..comm.readback import read_finite_probe
from ..errors import NonFiniteError
from ..options import require_choice

NonFinitePolicy = Literal["raise", "skip", "ignore"]
#: Under ``"skip"``, this many skipped steps in a row stop the job: the model has diverged.
MAX_CONSECUTIVE_SKIPS = 100


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite.

    One pass over each, one counted read (:func:`~mpisolve.comm.readback.read_finite_probe`;
    a solver's step reads it with its other values where it can).
    """
    if not tensors:
        return True
    return math.isfinite(read_finite_probe(tensors))


class NonFiniteGuard:
    """One solver's non-finite policy: checks, the count of skipped steps, the error."""

    def __init__(self, policy: NonFinitePolicy, comm: Communicator, solver: str) -> None:
        require_choice("nonfinite", policy, NonFinitePolicy)
        self.policy = policy
        self.comm = comm
        self.solver = solver
        #: Steps skipped because of non-finite values, on this rank.
        self.skipped = 0
        self.checks = 0
        self._skipped_in_a_row = 0
        self._flag = torch.zeros(1)  # on the host: read through its memory, never from a device
        self._flag_host = self._flag.numpy()

    def ok(self, tensors: Sequence[torch.Tensor], what: str) -> bool:
        """True: apply the step. False: skip it (``"skip"``, counted). Raises under ``"raise"``.

        The decision is this rank's own, which is the same on every rank when ``tensors``
        are the result of a reduction.
        """
        if self.policy == "ignore":
            return True
        return self.decide(all_finite(tensors), what)

    def agreed(self, finite: bool) -> bool:
        """Collective: whether ``finite`` holds on every rank (one 1-element allreduce)."""
        if self.comm.size == 1:
            return finite
        self._flag.fill_(0.0 if finite else 1.0)
        self.comm.allreduce_(self._flag, op="max", what="non-finite check")
        return bool(self._flag_host[0] == 0.0)

    def decide(self, finite: bool, what: str, *, agreed: bool = False) -> bool:
        """The policy applied to a finiteness already known (``agreed``: the same on every rank)."""
        if self.policy == "ignore":
            return True
        self.checks += 1
        if finite:
            self._skipped_in_a_row = 0
            return True
        where = "on some rank" if agreed else f"on rank {self.comm.rank}"
        if self.policy == "raise":
            raise NonFiniteError(
                f"solver {self.solver!r}: non-finite value (NaN or Inf) in the {what} {where} at step "
                f"{self.checks} (nonfinite='raise'; set nonfinite='skip' to skip such steps)"
            )
        self.skipped += 1
        self._skipped_in_a_row += 1
        if self._skipped_in_a_row >= MAX_CONSECUTIVE_SKIPS:
            raise NonFiniteError(
                f"solver {self.solver!r}: the {what} {where} were non-finite at {self._skipped_in_a_row} steps in a "
                f"row, up to step {self.checks}: the model has diverged (nonfinite='skip' stops after "
                f"{MAX_CONSECUTIVE_SKIPS}; lower the learning rate)"
            )
        return False
