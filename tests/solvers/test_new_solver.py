"""A new solver is one short class: registered, it gets the conformance oracle, the command
line, the docs' options table and checkpoints (docs/internals/solvers.md walks through it).

``test-mean`` is synchronous SGD with one blocking allreduce of the gradients per step:
the base class checks that it is open, makes each step a collective round, compares the
ranks' rounds at ``close``, and counts samples; the solver fills in ``setup``, ``_step``
and ``_free``.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.amp import GradScaler

import mpisolve
from mpisolve.options import option, parse_option, require, update_options_tables
from mpisolve.solvers import StepInfo, base
from mpisolve.solvers.base import Solver, SynchronousOptions, register, solver_class
from mpisolve.train.checkpoint import CheckpointDir
from mpisolve.train.config import add_arguments, train_config
from mpisolve.train.loop import train
from tests.conformance.harness import BY_ID, Case, assert_close, expected, run


# ---------------------------------------------------------------- the whole new solver
@dataclass(frozen=True, kw_only=True)
class MeanOptions(SynchronousOptions):
    """The new solver's one knob (besides ``nonfinite`` and ``broadcast_buffers``)."""

    scale: float = option(1.0, "a factor on the averaged gradients (1: their mean)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.scale > 0, f"scale must be > 0, got {self.scale}")


class MeanSolver(Solver[MeanOptions]):
    """Synchronous SGD: the gradients and the sample count in one allreduce per step."""

    name = "test-mean"
    Options = MeanOptions

    def setup(self) -> None:
        self.flat = torch.zeros(sum(p.numel() for p in self.params) + 1, dtype=torch.float64)

    def _step(self, batch_size: int | None, scaler: GradScaler | None) -> StepInfo:
        local = self.take_samples(batch_size)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        torch.cat([g.detach().reshape(-1).double() for g in grads], out=self.flat[:-1])
        self.flat[-1] = local
        self.comm.allreduce_(self.flat, what="test-mean step")
        mean = self.flat[:-1] * (self.options.scale / self.comm.size)
        applied = self.nonfinite.ok([mean], "averaged gradients")
        if applied:
            for p, g in zip(self.params, mean.split([p.numel() for p in self.params])):
                p.grad = g.view_as(p).to(p.dtype)
            self._step_optimizer(scaler)
        self._end_round(self.comm.size)
        return StepInfo(applied=applied, global_samples=int(self.flat[-1]) if applied else 0, local_samples=local)


# ---------------------------------------------------------------- what registering gives it
@pytest.fixture
def registered(monkeypatch):
    """``register(MeanSolver)``, undone after the test (the other tests list the solvers)."""
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    register(MeanSolver)


def test_registered_it_is_listed_and_its_options_are_checked(registered):
    assert "test-mean" in mpisolve.solver_names()
    assert solver_class("test-mean") is MeanSolver
    assert parse_option("test-mean", MeanOptions, "scale", "0.5") == 0.5
    with pytest.raises(mpisolve.OptionError, match="scale must be > 0, got -1"):
        MeanOptions(scale=-1.0)


def test_registered_it_has_a_docs_options_table(registered):
    page = update_options_tables("<!-- options: test-mean -->\n<!-- /options -->", lambda n: solver_class(n).Options)
    rows = [line.split("|")[1].strip() for line in page.splitlines() if line.startswith("| `")]
    assert rows == ["`nonfinite`", "`broadcast_buffers`", "`scale`"]


def test_registered_the_command_line_takes_it(registered):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--solver", "test-mean", "--set", "scale=0.5", "--steps", "2"])
    config = train_config(args, world_size=2)
    assert config.solver == "test-mean" and config.options["scale"] == 0.5


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_it_passes_the_sgd_oracle(comm, registered):
    """The conformance suite's oracle for SGD on the global batch's mean gradient, as allreduce's."""
    steps = 4
    got = run(Case("test-mean", "test-mean"), comm, steps)
    assert_close(got, expected(BY_ID["allreduce"], comm, steps), "test-mean against the SGD oracle")


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)
def test_the_trainer_checkpoints_and_resumes_it(comm, registered):
    """``mpisolve train --solver test-mean``: a run resumed from step 2 ends where the whole run does."""
    shared = Path(comm.bcast_object(tempfile.mkdtemp(prefix="mpisolve-new-solver-") if comm.rank == 0 else None))
    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def run_cli(directory: str, steps: int, *more: str) -> None:
        flags = ["--solver", "test-mean", "--model", "mlp", "--dataset", "digits", "--batch-size", "8"]
        flags += ["--steps", str(steps), "--checkpoint-dir", str(shared / directory), "--seed", "1", *more]
        train(train_config(parser.parse_args(flags), comm.size), comm, show=False)

    run_cli("whole", 4)
    run_cli("parts", 2)
    run_cli("parts", 4, "--resume")
    states = [CheckpointDir(shared / d, rank=comm.rank, size=comm.size).read_rank({}) for d in ("whole", "parts")]
    assert [step for step, _ in states] == [4, 4]
    for name, value in states[0][1]["model"].items():
        assert torch.equal(value, states[1][1]["model"][name]), name
    assert states[1][1]["solver"]["solver"] == "test-mean"
    comm.barrier()


@pytest.fixture
def comm():
    return mpisolve.init()
