"""Local SGD: every rank steps its own model, and every ``tau`` steps all models are averaged.

Between averages each rank applies the user's optimizer to its own copy of the model;
every ``tau``-th step one allreduce of the flat parameters (and of the samples each rank
saw since the last average, riding in the same message) replaces every copy by the
mean. The average is the global update: ``step`` reports it as applied, with the global
samples it covers, so every rank sees the same sequence of updates (lockstep) and the
models agree right after each one. Optimizer state (momentum) stays local.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..options import option, require
from .base import Solver, StepInfo, register
from .elastic import flatten_parameters


@dataclass(frozen=True, kw_only=True)
class LocalSGDOptions:
    """How often the models are averaged."""

    tau: int = option(4, "local steps between parameter averages (H); 4, as the EASGD family's exchange period")

    def __post_init__(self) -> None:
        require(self.tau >= 1, f"tau must be >= 1, got {self.tau}")


@register
class LocalSGD(Solver):
    """Local SGD with periodic parameter averaging (one allreduce every ``tau`` steps)."""

    name = "local-sgd"
    Options = LocalSGDOptions

    def setup(self) -> None:
        self.flat = flatten_parameters(self.params, who="local-sgd", extra=1)  # parameters, then a sample count
        self._average = self.comm.persistent_allreduce(self.flat)
        self.steps = 0
        self._since_average = 0  # this rank's samples since the last average

    def step(self, batch_size: int | None = None) -> StepInfo:
        """One local step; every ``tau``-th also averages the models (the applied global update)."""
        if self.closed:
            raise RuntimeError("solver 'local-sgd' is closed")
        local = self.take_samples(batch_size)
        # Each rank checks its own gradients and skips its local step alone: nothing non-finite is averaged.
        if self.nonfinite.ok([p.grad for p in self.params if p.grad is not None], "local gradients"):
            self.optimizer.step()
        self.steps += 1  # a skipped step still counts towards tau: averages stay on schedule
        self._since_average += local
        if self.steps % self.options.tau:
            return StepInfo(applied=False, global_samples=0, local_samples=local)
        self.flat[-1] = self._since_average
        self._average.start()
        self._average.wait("local-sgd average")
        global_samples = int(round(self.flat[-1].item()))
        self.flat[:-1].mul_(1.0 / self.comm.size)
        self._since_average = 0
        return StepInfo(applied=True, global_samples=global_samples, local_samples=local)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "steps": self.steps, "samples_since_average": self._since_average}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.steps = int(state["steps"])
        self._since_average = int(state["samples_since_average"])

    def close(self) -> None:
        if not self.closed:
            self._average.free()
        super().close()
