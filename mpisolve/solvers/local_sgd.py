"""Local SGD: every rank steps its own model, and every ``tau`` steps all models are averaged.

Between averages each rank applies the user's optimizer to its own copy of the model;
every ``tau``-th step one allreduce of the flat parameters (and of the samples each rank
saw since the last average, riding in the same message) replaces every copy by the
mean. The average is the global update: ``step`` reports it as applied, with the global
samples it covers, so every rank sees the same sequence of updates (lockstep) and the
models agree right after each one. Optimizer state (momentum) stays local.

Under ``join()`` a rank whose data has run out contributes its model to the next
average if it took local steps since the last one, and nothing after: an average is
the mean of the models of the ranks that contributed to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.amp import GradScaler

from ..comm.flat import TalliedBuffer, Tally
from ..options import LocalStepsOptions
from .base import CommonOptions, Solver, StepInfo, collective_round, register

#: Counts riding with the averaged models: samples since the last average, ranks that
#: contributed their model, ranks still in their loops (every one, but under ``join()``).
TALLY = Tally(samples=1, contributors=1, active=1)


@dataclass(frozen=True, kw_only=True)
class LocalSGDOptions(LocalStepsOptions, CommonOptions):
    """How often the models are averaged: every ``tau`` local steps (H in the papers)."""


@register
class LocalSGDSolver(Solver[LocalSGDOptions]):
    """Local SGD with periodic parameter averaging (one allreduce every ``tau`` steps)."""

    name = "local-sgd"
    round_per_step = False  # the rounds are the averages (every tau steps)
    Options = LocalSGDOptions
    round_unit = "averages"

    def setup(self) -> None:
        self._average = TalliedBuffer.of_parameters(self.comm, self.params, TALLY, who="local-sgd")
        self._params = self._average.body
        self.steps = 0
        self._since_average = 0  # this rank's samples since the last average
        self._moved = False  # this rank took a local step since the last average
        self._kept: torch.Tensor | None = None  # a joined rank's model while it contributes nothing

    def _step(self, batch_size: int | None, scaler: GradScaler | None) -> StepInfo:
        """One local step; every ``tau``-th also averages the models (the applied global update)."""
        self._unscale(scaler)
        local = self.take_samples(batch_size)
        # Each rank checks its own gradients and skips its local step alone: nothing non-finite is averaged.
        if self._may_apply([p.grad for p in self.params if p.grad is not None], "local gradients", scaler):
            self._step_optimizer(scaler)
            self._moved = True
        self.steps += 1  # a skipped step still counts towards tau: averages stay on schedule
        self._since_average += local
        if self.steps % self.options.tau:
            self._end_step()
            return StepInfo(applied=False, global_samples=0, local_samples=local)
        global_samples, contributors = self._average_models(active=True)
        return StepInfo(applied=contributors > 0, global_samples=global_samples, local_samples=local)

    @collective_round
    def _average_models(self, active: bool) -> tuple[int, int]:
        """The models' average, of the ranks that moved since the last one: (samples, contributors)."""
        contributes = active or self._moved
        if not contributes:
            if self._kept is None:
                self._kept = torch.empty_like(self._params)
            self._kept.copy_(self._params)
            self._params.zero_()
        counts = self._average.counts
        counts.set("samples", self._since_average)
        counts.set("contributors", int(contributes))
        counts.set("active", int(active))
        self._average.start()
        self._average.wait("local-sgd average")
        samples, contributors = counts.count("samples"), counts.count("contributors")
        if contributors > 0:
            self._params.mul_(1.0 / contributors)
        else:  # nobody moved: every model is the last average already
            assert self._kept is not None
            self._params.copy_(self._kept)
        self._since_average = 0
        self._moved = False
        self._end_round(counts.count("active"))
        return samples, contributors

    def _steps_taken(self) -> int:
        return self.steps

    def _shadow_round(self) -> bool:
        """A joined rank's part in the next average (its model if it moved since the last one)."""
        self.steps += self.options.tau - self.steps % self.options.tau
        self._average_models(active=False)
        return self._active_ranks > 0

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "steps": self.steps, "samples_since_average": self._since_average}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.steps = int(state["steps"])
        self._since_average = int(state["samples_since_average"])

    def _free(self) -> None:
        self._average.free()
