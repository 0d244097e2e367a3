"""The training loop behind ``python -m mpi4py -m mpisolve train``, generic over solvers.

Every rank runs, for each micro-batch of its own shard::

    solver.zero_grad(); loss = cross_entropy(model(x), y); loss.backward()
    slowdown.stretch(compute time)          # the emulated heterogeneous cluster
    info = solver.step()                    # maybe an update (info.applied)

and counts progress in applied updates and the global samples they covered (see
:mod:`mpisolve.train.schedule`), so that it evaluates, logs, checkpoints and stops at the
same point of its sequence of collectives as every other rank, whatever the solver:
synchronous, ABS-SGD (ranks compute different numbers of micro-batches per update) or
asynchronous. The trainer's own collectives run on a communicator split from the
solver's, so they never interleave with the solver's. Evaluation and checkpoint writing
are left out of the training wall clock (time to target accuracy is training time).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import random
import time
from collections.abc import Callable
from time import perf_counter
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..comm.communicator import Communicator
from ..comm.state import model_signature
from ..errors import CollectiveInputError
from ..options import option_fields, options_to_dict
from ..solvers import make_solver
from ..solvers.base import solver_class
from ..solvers.speeds import rank_clock
from . import config as train_settings
from . import faults
from .accounting import TimeAccount, split_time
from .checkpoint import CheckpointDir
from .config import TrainConfig
from .data import ShardStream, derive_seed, eval_shard, load_dataset, seed_everything
from .display import Display
from .hetero import Slowdown, moving_factor
from .metrics import RunLog, TensorBoardLog, run_facts, summary_path, write_json
from .models import model_for
from .schedule import AgreedCounter, Due, LockstepCounter, Progress, Schedule

#: Test examples evaluated per forward pass.
EVAL_CHUNK = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    train_settings.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from ..comm import init

    comm = init()
    config = comm.agree(lambda: train_settings.train_config(args, comm.size))
    summary = train(config, comm)
    if comm.rank == 0:
        print(json.dumps(summary), flush=True)
    return 0


def train(config: TrainConfig, comm: Communicator, *, show: bool = True) -> dict[str, Any]:
    """Run ``config`` on every rank of ``comm``; returns the run's summary (on every rank).

    Rank 0 writes the JSON Lines log and the summary when ``config.log`` is set and, with
    ``show``, shows progress on stderr. Bad input (a checkpoint that does not fit, a log
    that cannot be written) raises :class:`CollectiveInputError` on every rank.
    ``config.comm_timeout``, if set, becomes ``comm``'s watchdog timeout.
    """
    if config.comm_timeout is not None:
        comm.timeout_s = config.comm_timeout
    trainer = Trainer(config, comm, show=show)
    try:
        trainer.prepare()
        summary = trainer.run()
    except CollectiveInputError:
        trainer.close()
        raise
    trainer.close()
    return summary


class Trainer:
    """One run's state on one rank: data stream, model, solver, counters, clocks, outputs."""

    def __init__(self, config: TrainConfig, comm: Communicator, *, show: bool) -> None:
        self.config = config
        self.comm = comm
        self.ctrl = comm.dup()  # the trainer's own collectives, apart from the solver's
        rank, size = comm.rank, comm.size
        seed_everything(config.seed)  # a data set factory that draws random numbers draws the same on every rank
        self.data = self.ctrl.agree(
            lambda: load_dataset(config.dataset, size=config.data_size, image_size=config.image_size)
        )
        self.shard = self.ctrl.agree(
            lambda: ShardStream(self.data.train, rank=rank, size=size, seed=config.seed, batch_size=config.batch_size)
        )
        self.test = eval_shard(self.data.test, rank, size)
        # The same initial model everywhere (the solver broadcasts rank 0's anyway).
        self.model = self.ctrl.agree(lambda: model_for(config.model, self.data, seed=config.seed))
        # A solver with a momentum option of its own (async-msgd, async-measgd) applies it on
        # each local step; the optimizer it holds then runs without momentum.
        own_momentum = "momentum" in option_fields(solver_class(config.solver).Options)
        self.optimizer = torch.optim.SGD(
            self.model.parameters(),
            lr=config.lr,
            momentum=0.0 if own_momentum else config.momentum,
            weight_decay=config.weight_decay,
        )
        options = dict(config.options)
        if config.device_ms is not None and "progress" in option_fields(solver_class(config.solver).Options):
            # An emulated device stands for a GPU, whose rank's core waits while it computes: as a GPU rank's
            # progress="auto" does, a thread moves the solver's operations along meanwhile.
            options.setdefault("progress", "thread")
        self.solver = make_solver(config.solver, self.model, self.optimizer, comm, **options)
        faults.install(self.model, rank)  # MPISOLVE_FAULT, for reliability tests; nothing when unset
        seed_everything(derive_seed(config.seed, rank))  # each rank's own stream from here on
        self.slowdown = Slowdown(1.0)  # the emulated device is agreed by prepare()
        self.counter = LockstepCounter() if self.solver.lockstep else AgreedCounter(self.ctrl)
        self.schedule = Schedule(
            train_size=len(self.data.train),
            epochs=config.epochs,
            steps=config.steps,
            eval_every=config.eval_every,
            log_every=config.log_every,
            checkpoint_every=config.checkpoint_every,
            checkpoints=config.checkpoint_dir is not None,
        )
        self.checkpoints = (
            CheckpointDir(config.checkpoint_dir, rank=rank, size=size) if config.checkpoint_dir is not None else None
        )
        self.identity = {
            "model": config.model,
            "model_signature": hashlib.sha1(repr(model_signature(self.model)).encode()).hexdigest(),
            "dataset": config.dataset,
            "solver": config.solver,
        }
        # Outcomes so far (restored on resume).
        self.time_to_target_s: float | None = None
        self.epochs_to_target: float | None = None
        self.test_accuracy: float | None = None
        self.test_loss: float | None = None
        self.last_update_samples = 0
        self.clock = TimeAccount(comm)  # restarted by prepare(), from the checkpoint's times on resume
        self.log: RunLog | None = None
        self.board: TensorBoardLog | None = None
        self.display = Display(config.solver) if rank == 0 and show else None
        # Hot-path buffers (sized by prepare()) and the running interval (since the previous record).
        self._pred = self._pred_buffer = torch.empty(0, dtype=torch.long)
        self._hit = self._hit_buffer = torch.empty(0, dtype=torch.bool)
        self._samples = 0  # this rank's training samples in this process
        self._loss_sum = 0.0
        self._correct = 0
        self._count = 0
        self._mark = (0.0, 0.0)

    def prepare(self) -> None:
        """Resume from the checkpoint if asked, size the micro-batches, open the log, start the clocks.

        Agreed on every rank. The solver chooses this rank's micro-batch size (after a
        resumed solver has its state back, so that it can keep the size it chose).
        """
        config, rank = self.config, self.comm.rank
        wall_s = blocked_s = 0.0
        if config.resume:
            wall_s, blocked_s = self.ctrl.agree(self._load_checkpoint)
        factor: float | Callable[[], float] = config.hetero[rank] if config.hetero else 1.0
        if config.hetero_every is not None:
            start_s = self.ctrl.bcast_object(time.time())  # the moves count from rank 0's clock, now
            factor = functools.partial(
                moving_factor, config.hetero, rank, config.hetero_every, start_s, drift=config.hetero_drift
            )
        self.slowdown = Slowdown(factor, self._device_seconds_per_sample())
        self._resize(self.solver.local_batch_size(config.batch_size, self._probe))
        resume_step = self.counter.now.steps if config.resume else None
        self.log = self.ctrl.agree(
            lambda: RunLog(config.log, resume_step=resume_step) if rank == 0 and config.log is not None else None
        )
        self.board = self.ctrl.agree(
            lambda: (
                TensorBoardLog(config.tensorboard, resume_step=resume_step)
                if rank == 0 and config.tensorboard is not None
                else None
            )
        )
        self.clock = TimeAccount(self.comm, wall_s=wall_s, blocked_s=blocked_s)
        self._mark = (self.clock.wall_s(), self.clock.blocked_s())

    def _resize(self, batch_size: int) -> None:
        """Draw micro-batches of ``batch_size`` from here on (the buffers only grow)."""
        self.shard.resize(batch_size)
        if batch_size > len(self._pred_buffer):
            self._pred_buffer = torch.empty(batch_size, dtype=torch.long)
            self._hit_buffer = torch.empty(batch_size, dtype=torch.bool)
        self._pred, self._hit = self._pred_buffer[:batch_size], self._hit_buffer[:batch_size]

    def _compute_seconds(self, n: int) -> float:
        """Seconds of real compute (forward and backward, MPI waits excluded) on ``n`` training samples.

        It leaves no trace: the gradients come from ``torch.autograd.grad`` (no ``.grad``
        changes, no solver hook fires), batch-norm statistics are restored and its samples
        are not counted.
        """
        x, y = self.data.train.take(torch.arange(n) % len(self.data.train))
        buffers = [b.clone() for b in self.model.buffers()]
        start, blocked = perf_counter(), self.comm.blocked_s
        loss = F.cross_entropy(self.model(x), y)
        torch.autograd.grad(loss, self.solver.params, allow_unused=True)
        seconds = perf_counter() - start - (self.comm.blocked_s - blocked)
        with torch.no_grad():
            for buffer, saved in zip(self.model.buffers(), buffers):
                buffer.copy_(saved)
        self.solver.take_samples(None)
        return seconds

    def _probe(self, n: int) -> float:
        """Seconds one training micro-batch of ``n`` samples takes on this rank, slowdown included.

        For solvers that size batches by speed.
        """
        clock = rank_clock(self.comm.shares_cores_evenly)
        start = clock()
        self.slowdown.stretch(self._compute_seconds(n), n)
        return clock() - start

    def _device_seconds_per_sample(self) -> float | None:
        """The emulated device's time per sample (``--device-ms``), agreed by every rank; None without one.

        ``auto``: the ranks measure their compute one at a time (alone on the node's cores),
        and the slowest rank's time per sample is multiplied by the ranks sharing each core,
        times 2, so that compute contended by every rank at once (and the scheduler's jitter)
        still fits in it.
        """
        setting = self.config.device_ms
        if setting is None:
            return None
        if setting != "auto":
            return float(setting) / 1e3
        n = self.config.batch_size
        mine = math.inf
        for turn in range(self.comm.size):
            self.ctrl.barrier()
            if turn == self.comm.rank:
                mine = min(self._compute_seconds(n) for _ in range(3)) / n  # the first warms up
        sharing = math.ceil(self.comm.host_size / self.comm.cores)
        return max(self.ctrl.allgather_object(mine)) * sharing * 2.0

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict[str, Any]:
        model, solver, shard, counter = self.model, self.solver, self.shard, self.counter
        comm, slowdown = self.comm, self.slowdown
        before = counter.now
        if self.schedule.fraction(before) >= 1.0:  # resumed a run that had already finished
            return self._summary()
        counter.start()
        while True:
            x, y = shard.next_batch()
            solver.zero_grad()
            start, blocked = perf_counter(), comm.blocked_s
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            slowdown.stretch(perf_counter() - start - (comm.blocked_s - blocked), y.shape[0])
            info = solver.step()
            self._tally(loss, out, y)
            if info.next_batch_size is not None:  # the solver split the batch again (adaptive ABS-SGD)
                self._resize(info.next_batch_size)
            if info.applied:
                self.last_update_samples = info.global_samples
            now = counter.advance(info)
            if now is None:
                continue
            due = self.schedule.due(before, now)
            self._milestone(now, due)
            before = now
            if due.stop or (self.config.stop_at_target and self.time_to_target_s is not None):
                break  # the accuracy behind the decision is the same on every rank (allreduced)
        return self._summary()

    def _tally(self, loss: torch.Tensor, out: torch.Tensor, y: torch.Tensor) -> None:
        n = y.shape[0]
        self._samples += n
        self._loss_sum += loss.item() * n
        torch.argmax(out.detach(), 1, out=self._pred)
        torch.eq(self._pred, y, out=self._hit)
        self._correct += int(self._hit.sum())
        self._count += n

    def _milestone(self, now: Progress, due: Due) -> None:
        if due.evaluate:
            self._evaluate(now)
        if due.log:
            self._record(now, due.evaluate, important=due.evaluate or due.stop)
        if due.checkpoint:
            with self.clock.paused():
                self._save_checkpoint(now)

    # ---------------------------------------------------------------- evaluation
    def _evaluate(self, now: Progress) -> None:
        """Test accuracy and loss over every rank's test shard; notes the time and epochs to target."""
        self.ctrl.barrier("barrier before evaluation")  # waiting for the slowest rank is training time
        with self.clock.paused():
            totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
            with self.solver.evaluating() as model, torch.no_grad():
                was_training = model.training
                model.eval()
                for lo in range(0, len(self.test), EVAL_CHUNK):
                    x, y = self.test.rows(lo, min(lo + EVAL_CHUNK, len(self.test)))
                    out = model(x)
                    totals[0] += F.cross_entropy(out, y, reduction="sum").item()
                    totals[1] += int((out.argmax(1) == y).sum())
                    totals[2] += y.shape[0]
                model.train(was_training)
            self.ctrl.allreduce_(totals, what="evaluation allreduce")
        self.test_loss = totals[0].item() / totals[2].item()
        self.test_accuracy = totals[1].item() / totals[2].item()
        target = self.config.target_accuracy
        if target is not None and self.time_to_target_s is None and self.test_accuracy >= target:
            self.time_to_target_s = self.clock.wall_s()
            self.epochs_to_target = self.schedule.epoch(now)

    # ------------------------------------------------------------------- records
    def _record(self, now: Progress, evaluated: bool, *, important: bool) -> None:
        wall, blocked = self.clock.wall_s(), self.clock.blocked_s()
        last_wall, last_blocked = self._mark
        skipped = self.solver.nonfinite.skipped
        mine = (wall - last_wall, blocked - last_blocked, self._loss_sum, self._correct, self._count, skipped)
        everyone = self.ctrl.allgather_object(mine)
        busy, comm, idle = split_time([e[0] for e in everyone], [e[1] for e in everyone])
        count = sum(e[4] for e in everyone)
        record = {
            "step": now.steps,
            "epoch": self.schedule.epoch(now),
            "wall_s": wall,
            "loss": sum(e[2] for e in everyone) / max(count, 1),
            "train_accuracy": sum(e[3] for e in everyone) / max(count, 1),
            "test_accuracy": self.test_accuracy if evaluated else None,
            "test_loss": self.test_loss if evaluated else None,
            "global_samples": self.last_update_samples,
            # Each rank's samples over its own interval, summed: the agreed progress of an
            # asynchronous solver lags (a round carries counts from when it was posted), so
            # its difference between two records is not what was trained in between.
            "samples_per_s": sum(e[4] / max(e[0], 1e-9) for e in everyone),
            "busy": busy,
            "comm": comm,
            "idle": idle,
            "skipped_steps": [e[5] for e in everyone],
        }
        self._loss_sum, self._correct, self._count = 0.0, 0, 0
        self._mark = (wall, blocked)
        if self.log is not None:
            self.log.write(record)
        if self.board is not None:
            self.board.write(record)
        if self.display is not None:
            self.display.update(
                self.schedule.fraction(now),
                {
                    "epoch": round(record["epoch"], 2),
                    "loss": record["loss"],
                    "train_acc": record["train_accuracy"],
                    "test_acc": record["test_accuracy"],
                    "wall_s": round(wall, 1),
                },
                important=important,
            )

    def _summary(self) -> dict[str, Any]:
        wall = self.clock.wall_s()
        skipped = self.solver.nonfinite.skipped
        overrun = self.slowdown.overruns / max(self.slowdown.batches, 1)
        per_sample = self.slowdown.device_s_per_sample
        everyone = self.ctrl.allgather_object(
            (wall, self.clock.blocked_s(), self.shard.batch_size, self._samples, skipped, overrun)
        )
        busy, comm, idle = split_time([e[0] for e in everyone], [e[1] for e in everyone])
        now = self.counter.now
        summary = {
            "solver": self.config.solver,
            "options": options_to_dict(self.solver.options),
            "ranks": self.comm.size,
            **self.ctrl.bcast_object(run_facts(self.comm.library_version()) if self.comm.rank == 0 else None),
            "workload": self.config.workload(),
            "target_accuracy": self.config.target_accuracy,
            "time_to_target_s": self.time_to_target_s,
            "epochs_to_target": self.epochs_to_target,
            "final_accuracy": self.test_accuracy,
            "final_test_loss": self.test_loss,
            "steps": now.steps,
            "epochs": self.schedule.epoch(now),
            "wall_s": wall,
            "samples_per_s": now.samples / max(wall, 1e-9),
            "busy_fraction": sum(busy) / len(busy),
            "busy": busy,
            "comm": comm,
            "idle": idle,
            "batch_sizes": [e[2] for e in everyone],
            "samples_by_rank": [e[3] for e in everyone],
            "skipped_steps": [e[4] for e in everyone],
            # Per rank, the fraction of micro-batches whose real compute overran the emulated device.
            "device_overruns": [e[5] for e in everyone],
            "device_ms_per_sample": None if per_sample is None else per_sample * 1e3,
        }
        if self.comm.rank == 0 and self.config.log is not None:
            write_json(summary_path(self.config.log), summary)
        return summary

    # --------------------------------------------------------------- checkpoints
    def _state(self) -> dict[str, Any]:
        numpy_state = np.random.get_state(legacy=True)
        assert isinstance(numpy_state, tuple)  # the global generator is MT19937, whose legacy state is a tuple
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "solver": self.solver.state_dict(),
            "data": self.shard.state_dict(),
            "progress": self.counter.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
                "python": random.getstate(),
            },
            "run": {
                "wall_s": self.clock.wall_s(),
                "blocked_s": self.clock.blocked_s(),
                "time_to_target_s": self.time_to_target_s,
                "epochs_to_target": self.epochs_to_target,
                "test_accuracy": self.test_accuracy,
                "test_loss": self.test_loss,
                "last_update_samples": self.last_update_samples,
            },
        }

    def _save_checkpoint(self, now: Progress) -> None:
        assert self.checkpoints is not None
        checkpoints, state = self.checkpoints, self._state()
        self.ctrl.agree(lambda: checkpoints.write_rank(now.steps, self.identity, state))
        self.ctrl.agree(lambda: checkpoints.commit(now.steps) if self.comm.rank == 0 else None)
        checkpoints.prune(now.steps)

    def _load_checkpoint(self) -> tuple[float, float]:
        """Restore this rank's state from the committed checkpoint; (wall_s, blocked_s) so far."""
        assert self.checkpoints is not None
        _, state = self.checkpoints.read_rank(self.identity)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.solver.load_state_dict(state["solver"])
        self.shard.load_state_dict(state["data"])
        self.counter.load_state_dict(state["progress"])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        numpy_state = rng["numpy"]
        np.random.set_state((numpy_state[0], np.array(numpy_state[1], dtype=np.uint32), *numpy_state[2:]))
        random.setstate(_as_tuples(rng["python"]))
        run = state["run"]
        self.time_to_target_s = run["time_to_target_s"]
        self.epochs_to_target = run["epochs_to_target"]
        self.test_accuracy = run["test_accuracy"]
        self.test_loss = run["test_loss"]
        self.last_update_samples = run["last_update_samples"]
        return float(run["wall_s"]), float(run["blocked_s"])

    def close(self) -> None:
        self.counter.close()
        self.solver.close()
        if self.log is not None:
            self.log.close()
        if self.board is not None:
            self.board.close()
        if self.display is not None:
            self.display.close()


def _as_tuples(value: Any) -> Any:
    """``random.setstate`` wants the nested tuples ``getstate`` gave (a checkpoint may hold lists)."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuples(v) for v in value)
    return value
