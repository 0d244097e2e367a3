"""ABS-SGD: delayed synchronous SGD with an adaptive batch size (Zhou, Chen, Wu, 2023; reconstructed).

Per worker, round after round::

    post a nonblocking allreduce of (G, n)          # summed gradients and sample count of the last round
    G, n = 0, 0
    repeat: one micro-batch at the current w; G += its summed gradient; n += its size
    until that allreduce has completed              # at least one micro-batch per round
    w <- w - lr * (sum over ranks of the last round's G) / (sum of its n)

A collective completes only once every rank has joined it, so the slowest worker paces
the rounds while the faster ones fill the wait with more micro-batches, and the update is
the sample-weighted mean of gradients one round old. Every rank applies the same rounds in
the same order with the same global sample count: the solver is lockstep.

In the user's loop this is one ``step()`` per micro-batch: it adds the micro-batch to the
round's sums, tests the previous round's allreduce (which is what moves it along between
micro-batches), and when that has completed applies its mean through the user's
optimizer, posts this round's sums and starts a new round. Two fused buffers (one
accumulating, one in flight) alternate, each with its own persistent sum, so a round's
gradients are never allocated. Where ranks share a node the sums are node-shared
(:func:`mpisolve.comm.reusable.reusable_sum`), else the engine's (MPI's persistent allreduce, or NCCL's). MPI's progress
engine moves its allreduce along in any MPI call; a node-shared round moves only when the
rank tests it, so every wait on the solver's communicator tests it too (between its polls),
as the progress thread does while the rank computes. ``progress='mpich'`` keeps MPI's path:
MPICH's thread moves MPI's operations only.

At one rank a round's sum completes as it is posted: with ``trigger="collective"`` each
micro-batch is applied in its own step, with no delay to compensate (docs/solvers/abs-sgd.md,
"One rank").

A rank waiting in a bounded round (``max_round_batches``) waits for the others to post
their next round, which a rank does in its next ``step()``. A rank waiting meanwhile in a
collective of the user's (a metric's allreduce every few steps) would never get there, and
each would wait for the other. So a bounded round's wait ends once the round has been in
flight :data:`STALL_ROUNDS` times as long as the shortest recent round took (at least
:data:`STALL_MIN_S`; :data:`STALL_FIRST_S` before any round completed): the rank goes on
computing micro-batches into its next round, past the bound, until that round completes.

The rule above follows the paper's abstract; the choices it leaves open are the options
below. Three defaults make it converge
wherever synchronous SGD does (docs/solvers/abs-sgd.md derives them, docs/studies/abs-sgd.md
measures them):

- ``max_round_batches=1``: a rank computes one micro-batch per round, then waits for the
  previous round's allreduce. Unbounded rounds (the rule as written) grow to several times
  synchronous SGD's global batch wherever the allreduce outlasts a micro-batch, and at one
  learning rate each update then costs that many more samples.
- ``weight_prediction=1.5``: a round's micro-batches compute their gradients at the weights
  predicted for when the round is applied, ``w + c (w - w_before_last_update)``. The model
  holds the predicted weights while it trains; :meth:`ABSSGDSolver.evaluating`, ``close`` and
  checkpoints keep the true ones.
- ``momentum_correction=True``: a gradient one round late acts as one more round of
  momentum (Mitliagkas et al., 2016), so each update runs the optimizer's momentum lowered
  to keep synchronous SGD's memory in samples, and its learning rate raised to keep its
  step ``lr / (1 - momentum)``.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.amp import GradScaler

from ..comm.buckets import wire_dtype
from ..comm.closing import CloseNotices
from ..comm.communicator import Communicator
from ..comm.engine import Reusable
from ..comm.flat import FusedBuffer, Tally
from ..comm.progress import Progress, ProgressThread, resolve_progress
from ..comm.readback import Readback, write_finite_probe
from ..comm.reusable import reusable_sum
from ..comm.shm import NodePersistentAllreduce
from ..errors import CommTimeout, UnsupportedModelError
from ..options import MeasureOptions, option, require
from .base import CommonOptions, Solver, StepInfo, register
from .nonfinite import all_finite
from .speeds import measure_speeds, proportional_batches, rank_clock, resplit

Trigger = Literal["collective", "window", "samples"]
LRScaling = Literal["none", "linear", "sqrt"]
MicroBatch = Literal["adaptive", "speed", "fixed"]

#: Rounds of measured speeds the adaptive split is judged on: their per-rank medians, where that split would
#: have made each of them shorter by a margin (one slow round does not move it: :func:`.speeds.resplit`).
SPEED_ROUNDS = 3

#: A bounded round's wait ends once the round has been in flight this many times the shortest of
#: the recent rounds that did not stall (another rank may be in a collective of the user's, not in
#: its step; a round that completed during one also takes long, hence the shortest).
STALL_ROUNDS = 20
#: ... but never sooner than this many seconds, and this long before any round completed.
STALL_MIN_S = 0.5
STALL_FIRST_S = 1.0

#: The least momentum ``momentum_correction`` gives an optimizer that has some: at 0, torch's SGD
#: would skip its velocity buffer, and the next update would start from a stale one.
MOMENTUM_FLOOR = 1e-3


@dataclass(frozen=True, kw_only=True)
class ABSSGDOptions(MeasureOptions, CommonOptions):
    """When a round ends, how an update follows the delay and the round's batch, who moves
    MPI along, how large each rank's micro-batches are (docs/solvers/abs-sgd.md)."""

    trigger: Trigger = option(
        "collective",
        "when a round ends: at the first micro-batch after the previous round's allreduce completed; 'window': "
        "also not before window_s seconds; 'samples': a round whose global count (with any carried before it) is "
        "below min_samples is carried into the next",
    )
    window_s: float | None = option(None, "trigger='window': the shortest round, in seconds on this rank")
    min_samples: int | None = option(None, "trigger='samples': the smallest global sample count of an update")
    lr_scaling: LRScaling = option(
        "none",
        "each update's learning rate: as given, or times N / reference_batch ('linear') or its square root "
        "('sqrt'), N the update's global samples",
    )
    reference_batch: int | None = option(
        None,
        "the global batch lr_scaling and momentum_correction compare an update's with (default: the first "
        "update's, synchronous SGD's global batch)",
    )
    progress: Progress = option(
        "auto",
        "who moves the allreduce along while the rank computes: 'auto' is 'thread' where the thread has a core to "
        "itself (a GPU rank, or 2 cores or more a rank), else 'none'; 'thread': a thread testing it every "
        "progress_ms; 'mpich': "
        "MPICH's own thread (launch with MPICH_ASYNC_PROGRESS=1); 'none': step()'s tests only",
    )
    progress_ms: float = option(1.0, "the progress thread's interval, in milliseconds", above=0)
    micro_batch: MicroBatch = option(
        "adaptive",
        "each rank's micro-batch: synchronous SGD's global batch split by the speeds every rank measures, split "
        "again as they change; 'speed': split once; 'fixed': the configured size everywhere",
    )
    weight_prediction: float = option(
        1.5,
        "delay compensation c: a round's gradients are computed at w + c * (the last update); 0: at w, the rule "
        "as written",
    )
    max_round_batches: int | None = option(
        1,
        "micro-batches a rank computes per round before it waits for the previous round's allreduce; None: no "
        "limit (the rule as written)",
    )
    momentum_correction: bool = option(
        True,
        "each update lowers the optimizer's momentum for the one-round delay and the round's batch and raises "
        "its lr to keep lr / (1 - momentum); False: the optimizer's settings as given",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            (self.trigger == "window") == (self.window_s is not None),
            "window_s goes with trigger='window' (and it needs one); "
            f"got trigger={self.trigger!r}, window_s={self.window_s}",
        )
        require(
            self.window_s is None or (math.isfinite(self.window_s) and self.window_s > 0),
            f"window_s must be > 0 seconds, got {self.window_s}",
        )
        require(
            (self.trigger == "samples") == (self.min_samples is not None),
            f"min_samples goes with trigger='samples' (and it needs one); got trigger={self.trigger!r}, "
            f"min_samples={self.min_samples}",
        )
        require(self.min_samples is None or self.min_samples >= 1, f"min_samples must be >= 1, got {self.min_samples}")
        require(
            self.reference_batch is None or self.lr_scaling != "none" or self.momentum_correction,
            "reference_batch is used by lr_scaling='linear' or 'sqrt' and by momentum_correction only",
        )
        require(
            self.reference_batch is None or self.reference_batch >= 1,
            f"reference_batch must be >= 1, got {self.reference_batch}",
        )
        require(
            self.max_round_batches is None or self.max_round_batches >= 1,
            f"max_round_batches must be >= 1 or None, got {self.max_round_batches}",
        )
        require(
            math.isfinite(self.weight_prediction) and self.weight_prediction >= 0,
            f"weight_prediction must be a finite number >= 0, got {self.weight_prediction}",
        )


def corrected_momentum(momentum: float, ratio: float, delay: int = 1) -> float:
    """The momentum of an update ``ratio`` times synchronous SGD's global batch, ``delay`` rounds late.

    Heavy-ball momentum ``b`` remembers ``b / (1 - b)`` steps; synchronous SGD's steps
    hold one global batch each, so it remembers ``momentum / (1 - momentum)`` global
    batches. An update of ``ratio`` global batches whose gradient is ``delay`` rounds old
    remembers ``b / (1 - b) + delay`` rounds (a stale gradient acts as momentum: Mitliagkas
    et al., 2016) of ``ratio`` batches each. Equal memories give ``b / (1 - b) =
    momentum / (1 - momentum) / ratio - delay``, floored at 0 (at ``MOMENTUM_FLOOR`` in ``b``).
    """
    memory = max(momentum / (1.0 - momentum) / ratio - delay, 0.0)
    return max(memory / (1.0 + memory), MOMENTUM_FLOOR)


@register
class ABSSGDSolver(Solver[ABSSGDOptions]):
    """Delayed synchronous SGD with an adaptive batch size: no worker waits for another."""

    name = "abs-sgd"
    Options = ABSSGDOptions
    #: A rank may stop rounds before the others: ``close`` lets it catch up (see there).
    tolerates_uneven = True
    round_per_step = False  # a round spans the micro-batches until the previous round's allreduce completes
    # Made by _set_up_rounds, not at one rank (alone), whose step never reads them:
    #: The micro-batch's gradients, flat (``p.grad`` are its views).
    grads: FusedBuffer
    _readback: Readback
    _control: Communicator

    def setup(self) -> None:
        #: Who moves the rounds along: :attr:`ABSSGDOptions.progress`, with "auto" made a choice.
        self.progress = resolve_progress(self.options.progress, self.comm)
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) != 1:
            raise UnsupportedModelError(
                f"abs-sgd needs trainable parameters of one dtype on one device, got {sorted(map(str, kinds))}"
            )
        dtype, device = kinds.pop()
        #: One rank, ``trigger="collective"``, staging not forced: a round's sum completes as it is
        #: posted, so each micro-batch is applied in its own step, with no delay to compensate (no
        #: weight prediction; the momentum correction for no delay is the optimizer's own): plain
        #: SGD's step on the parameters' own gradients (docs/solvers/abs-sgd.md, "One rank").
        self.alone = self.comm.size == 1 and self.options.trigger == "collective" and not self.comm.stage_all
        wire = wire_dtype(dtype)
        self._wire = wire
        numel = self._numel = sum(p.numel() for p in self.params)
        #: The counts riding at the end of a round's sums: its samples, then one slot per rank for its
        #: measured speed (a sum of one nonzero term: exact everywhere).
        self._tally = Tally(samples=1, speeds=self.comm.size)
        #: Two rounds' sums, one accumulating, one in flight: the gradients, then the tally (none alone).
        self._sums: list[torch.Tensor] = []
        self._rounds: list[Reusable] = []
        self._carry = torch.zeros(numel + 1, dtype=wire, device=device) if self.options.trigger == "samples" else None
        if not self.alone:  # alone: no buffer, round or readback of its own (the step is the optimizer's)
            self._set_up_rounds(dtype, device)
        #: With weight prediction: the true weights (the model holds the predicted ones) and the last update.
        self._weights = self._last_update = None
        if self.options.weight_prediction > 0 and not self.alone:
            shapes = self.grads.shapes
            self._weights = FusedBuffer(shapes, dtype, device)
            self._weights.pack([p.detach() for p in self.params])
            self._last_update = FusedBuffer(shapes, dtype, device)
        # A rank that stops early announces it, so that a bounded round stops waiting for its
        # contribution (close() then evens the ranks' rounds).
        self._closings = CloseNotices(self.comm, lambda: None, self.name, "rounds") if self.comm.size > 1 else None
        self._acc = 0  # index of the accumulating buffer; the other one is in flight
        self._in_flight = False  # a posted round not yet applied (or carried)
        self._known_done = False  # ... whose allreduce is known to have completed
        self._posted_at = 0.0
        self._round_samples = self._round_batches = 0
        # This round's timed micro-batches: each from its first training forward to its step.
        self._timed_samples = 0
        self._timed_s = 0.0
        self._clock = rank_clock(self.comm.shares_cores_evenly and device.type == "cpu")
        #: The last rounds' speeds of every rank (samples/s), the same on every rank.
        self._speeds: deque[list[float]] = deque(maxlen=SPEED_ROUNDS)
        #: The last rounds' durations on this rank, from posting to applying (seconds).
        self._durations: deque[float] = deque(maxlen=SPEED_ROUNDS)
        #: Whether a bounded wait gave up on the round in flight (its duration then measures the stall).
        self._stalled = False
        self._next_batch_size: int | None = None
        #: Rounds this rank has posted, updates it has applied.
        self.rounds = 0
        self.updates = 0
        self.reference_batch: float | None = self.options.reference_batch
        #: Every rank's micro-batch size, once ``local_batch_size`` decided it by speed (and as re-split).
        self.batch_sizes: list[int] | None = None
        self._watch_lock = threading.Lock()
        #: The round in flight until it is seen complete: tested by step(), the progress thread
        #: and, on the node-shared path, every wait on the communicator.
        self._watched: Reusable | None = None
        self._done = threading.Event()
        #: A node-shared round moves only when this rank tests it (MPI's moves in any MPI call):
        #: a wait for anything else, in close() or the user's collectives, must not stall the others.
        self._drives_waits = bool(self._rounds) and isinstance(self._rounds[0], NodePersistentAllreduce)
        if self._drives_waits:
            self.comm.interrupts.append(self._watch)
        interval_s = self.options.progress_ms / 1e3
        self._thread = (
            ProgressThread(self._watch, name="mpisolve-abs-sgd-progress", interval_s=interval_s)
            if self.progress == "thread" and not self.alone
            else None
        )

    def _set_up_rounds(self, dtype: torch.dtype, device: torch.device) -> None:
        """Several ranks (or delayed rounds at one): the flat gradients, the two rounds' sums, their readback."""
        # p.grad are views into one flat buffer: a micro-batch joins the round in one add.
        self.grads = FusedBuffer([p.shape for p in self.params], dtype, device)
        self._point_grads_at_views()
        size = self._numel + self._tally.size
        self._sums = [torch.zeros(size, dtype=self._wire, device=device) for _ in range(2)]
        # The rounds on a communicator of their own: a rank posts its next round before or after
        # a collective of the user's, as its last round completed, so sharing one with the user's
        # would start them in different orders on different ranks (node-shared sums post their
        # inter-node parts in start order, and waited on each other until the watchdog). Waits
        # on it still run this communicator's interrupts.
        rounds_comm = self.comm.dup(name="abs-sgd rounds")
        if self.progress == "mpich":  # MPICH's thread moves MPI's allreduce, not a node-shared sum
            self._rounds = [rounds_comm.persistent_allreduce(s) for s in self._sums]
        else:
            self._rounds = [reusable_sum(rounds_comm, s) for s in self._sums]
        #: What the host reads of a round, at once: its tally, then its finite probe.
        self._readback = Readback(self._tally.size + 1, device)
        self._control = self.comm.dup(name="abs-sgd close")  # close()'s agreement, apart from the rounds

    def local_batch_size(self, configured: int, probe: Callable[[int], float] | None = None) -> int:
        """This rank's micro-batch: ``configured``, or by speed (collective, the first time; see the options)."""
        if self.options.micro_batch == "fixed" or self.alone:
            return configured
        if self.batch_sizes is None:
            who = f"abs-sgd with micro_batch={self.options.micro_batch!r} (or use micro_batch='fixed')"
            speeds = measure_speeds(self.comm, configured, probe, self.options.measure_batches, who=who)
            self.batch_sizes = proportional_batches(speeds, configured * self.comm.size)
        return self.batch_sizes[self.comm.rank]

    # ---------------------------------------------------------------- gradients
    def _point_grads_at_views(self) -> None:
        for p, view in zip(self.params, self.grads.views):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                if p.grad is None:  # set to None and then given no gradient: it contributes zeros
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view

    def zero_grad(self) -> None:
        """Zero this micro-batch's gradients (one fill of the flat buffer; alone: set to None, as torch's default)."""
        if self.alone:
            self.optimizer.zero_grad()
            return
        self.grads.flat.zero_()
        self._point_grads_at_views()

    # -------------------------------------------------------------------- step
    def _step(self, batch_size: int | None, scaler: GradScaler | None) -> StepInfo:
        """Add this micro-batch to the round; apply last round's mean if its allreduce has completed.

        ``scaler``: the micro-batch's gradients are unscaled; a non-finite micro-batch is left
        out of the round (the scaler's skip); the rounds go on as usual.
        """
        if self.alone:
            return self._step_alone(batch_size, scaler)
        started_at = self._forward_at  # this micro-batch's first training forward
        n = self.take_samples(batch_size)
        if n == 0:  # no micro-batch: nothing to add, and a round needs one
            self._end_step()
            return StepInfo(applied=False, global_samples=0, local_samples=0)
        if started_at is not None:
            self._timed_s += self._clock() - started_at
            self._timed_samples += n
        self._point_grads_at_views()  # gradients set to None by the user come back into the buffer
        finite = True
        if scaler is not None and scaler.is_enabled():
            self._unscale(scaler)
            finite = all_finite([self.grads.flat])
        self._end_step()
        if finite:
            self._sums[self._acc][: self._numel].add_(self.grads.flat, alpha=n)  # the mean gradient, summed
            self._round_samples += n
        self._round_batches += 1
        if self._in_flight and not self._round_over():
            limit = self.options.max_round_batches
            if limit is None or self._round_batches < limit:
                return StepInfo(applied=False, global_samples=0, local_samples=n)
            # This rank's share of the round is done: wait for it, unless a rank stopped (it posts no more)
            # or the round stalls (a rank waits in a collective of the user's: it posts at its next step).
            self._complete_in_flight("abs-sgd round", unless_peer_closed=True)
            if not self._round_over():  # trigger="window", a rank stopped, a stall: the round is not over yet
                return StepInfo(applied=False, global_samples=0, local_samples=n)
        applied, samples = self._finish_round() if self._in_flight else (False, 0)
        self._post()
        resized, self._next_batch_size = self._next_batch_size, None
        return StepInfo(applied=applied, global_samples=samples, local_samples=n, next_batch_size=resized)

    def _step_alone(self, batch_size: int | None, scaler: GradScaler | None) -> StepInfo:
        """One rank: the micro-batch is a round whose sum is its own, applied at once through the optimizer."""
        n = self.take_samples(batch_size)
        self._unscale(scaler)
        self._end_step()
        if n == 0:
            return StepInfo(applied=False, global_samples=0, local_samples=0)
        grads = [grad for p in self.params if (grad := p.grad) is not None]
        if scaler is not None and scaler.is_enabled():
            applied = all_finite(grads)  # the scaler's skip
        else:
            checked = self.nonfinite.policy != "ignore"
            applied = not checked or self.nonfinite.decide(all_finite(grads), "round's mean gradients")
        self.rounds += 1
        if applied:
            self._scaled_step(n, delay=0)
            self.updates += 1
        return StepInfo(applied=applied, global_samples=n if applied else 0, local_samples=n)

    def _round_over(self) -> bool:
        """Whether the round in flight has completed and this rank's round may end."""
        if not self._completed():
            if time.perf_counter() - self._posted_at > self.comm.timeout_s:
                raise CommTimeout(
                    f"mpisolve: abs-sgd round {self.rounds - 1} did not complete within {self.comm.timeout_s:g} s "
                    f"on rank {self.comm.rank} of {self.comm.size} (watchdog; set MPISOLVE_TIMEOUT to change it)"
                )
            return False
        if self.options.window_s is not None:  # trigger="window" (the options give both or neither)
            return time.perf_counter() - self._posted_at >= self.options.window_s
        return True

    def _completed(self) -> bool:
        if not self._known_done:
            if self._thread is None:
                self._watch()
            self._known_done = self._done.is_set()
        return self._known_done

    def _watch(self) -> None:
        """Test the round in flight; say when it completed (any thread: the progress thread's poke)."""
        with self._watch_lock:
            round_ = self._watched
            if round_ is not None and round_.test():
                self._watched = None
                self._done.set()

    def _finish_round(self) -> tuple[bool, int]:
        """Apply (or carry) the completed round in flight: (applied, its global sample count)."""
        index = 1 - self._acc
        self._rounds[index].wait("abs-sgd round")  # completed already: brings staged results back
        self._in_flight = False
        if not self._stalled:  # a stalled round's time would lengthen the next waits, and so on
            self._durations.append(time.perf_counter() - self._posted_at)
        numel = self._numel
        reduced = self._sums[index][: numel + 1]
        if self._carry is not None:
            reduced = self._carry.add_(reduced)
        # One read: the samples, every rank's speed, and whether the sums are finite.
        readback, tally = self._readback, self._tally
        readback.values[: tally.size].copy_(self._sums[index][numel:])
        if self._carry is not None:  # the samples carried too
            readback.values[tally.at["samples"]].copy_(reduced[numel])
        checked = self.nonfinite.policy != "ignore"
        if checked:
            write_finite_probe([reduced[:numel]], readback.values[tally.size])
        values = readback.fetch()
        if self.options.micro_batch == "adaptive" and self.batch_sizes is not None:
            self._resplit(list(values[tally.span["speeds"]]))
        total = int(round(values[tally.at["samples"]]))
        least = self.options.min_samples  # trigger="samples" (the options give both or neither)
        if self._carry is not None and least is not None and total < least:
            return False, 0
        if total == 0:  # an empty round (only from close): nothing to apply
            return False, 0
        # The round's mean is the same everywhere: every rank decides alike, unasked.
        if checked and not self.nonfinite.decide(math.isfinite(values[tally.size]), "round's mean gradients"):
            if self._carry is not None:
                self._carry.zero_()
            return False, 0
        torch.mul(reduced[:numel], 1.0 / total, out=self.grads.flat)
        self._optimizer_step(total)
        if self._carry is not None:
            self._carry.zero_()
        self.updates += 1
        return True, total

    def _resplit(self, speeds: list[float]) -> None:
        """Split the batch again by every rank's recent speeds where they say so (the same on every rank)."""
        assert self.batch_sizes is not None  # called once local_batch_size has split the batch
        if min(speeds) <= 0:
            return  # a rank timed nothing this round
        self._speeds.append(speeds)
        if len(self._speeds) < SPEED_ROUNDS:
            return  # one round's speeds are its noise
        sizes = resplit(self.batch_sizes, self._speeds)
        if sizes != self.batch_sizes:
            if sizes[self.comm.rank] != self.batch_sizes[self.comm.rank]:
                self._next_batch_size = sizes[self.comm.rank]
            self.batch_sizes = sizes

    def _optimizer_step(self, global_samples: int) -> None:
        """The user's optimizer steps from the true weights; the model then holds the next prediction."""
        if self._weights is None:
            self._scaled_step(global_samples)
            return
        self._hold_true_weights()
        self._scaled_step(global_samples)
        c = self.options.weight_prediction
        assert self._last_update is not None  # built with _weights
        with torch.no_grad():  # one pass: record the update and the new true weights, then predict
            for p, w, step in zip(self.params, self._weights.views, self._last_update.views):
                torch.sub(p, w, out=step)
                w.copy_(p)
                p.add_(step, alpha=c)

    def _hold_true_weights(self) -> None:
        assert self._weights is not None  # called with weight prediction only
        with torch.no_grad():
            for p, w in zip(self.params, self._weights.views):
                p.copy_(w)

    def _hold_predicted_weights(self) -> None:
        """The model's weights become ``w + c * (last update)`` (the model holds ``w``)."""
        assert self._last_update is not None  # called with weight prediction only
        with torch.no_grad():
            for p, step in zip(self.params, self._last_update.views):
                p.add_(step, alpha=self.options.weight_prediction)

    @contextmanager
    def _evaluation(self) -> Iterator[torch.nn.Module]:
        """The model holds the true weights for the duration (not the predicted ones it trains at)."""
        if self._weights is None or self.closed:
            yield self.model
            return
        self._hold_true_weights()
        try:
            yield self.model
        finally:
            self._hold_predicted_weights()

    def _scaled_step(self, global_samples: int, delay: int = 1) -> None:
        """The user's optimizer steps with this update's learning rate and momentum (docs/solvers/abs-sgd.md),
        for a gradient ``delay`` rounds old."""
        scaling, correct = self.options.lr_scaling, self.options.momentum_correction
        if scaling == "none" and not correct:
            self._step_optimizer(None)
            return
        if self.reference_batch is None:
            self.reference_batch = float(global_samples)
        ratio = global_samples / self.reference_batch
        if scaling == "none" and delay == 0 and ratio == 1.0:  # corrected for nothing: the optimizer as given
            self._step_optimizer(None)
            return
        factor = 1.0 if scaling == "none" else ratio if scaling == "linear" else math.sqrt(ratio)
        groups = self.optimizer.param_groups
        given = [(group["lr"], group.get("momentum")) for group in groups]
        for group, (lr, momentum) in zip(groups, given):
            group["lr"] = lr * factor
            if correct and momentum and not group.get("dampening"):
                group["momentum"] = corrected_momentum(momentum, ratio, delay)
                group["lr"] *= (1.0 - group["momentum"]) / (1.0 - momentum)
        try:
            self._step_optimizer(None)
        finally:
            for group, (lr, momentum) in zip(groups, given):
                group["lr"] = lr
                if momentum is not None:
                    group["momentum"] = momentum

    def _post(self) -> None:
        """Start this round's allreduce and a new round in the other buffer."""
        index = self._acc
        sums, at = self._sums[index], self._numel
        sums[at + self._tally.at["samples"]].fill_(self._round_samples)
        speed = self._timed_samples / self._timed_s if self._timed_s > 0 else 0.0
        sums[at + self._tally.at["speeds"] + self.comm.rank].fill_(speed)
        self._rounds[index].start()
        with self._watch_lock:
            self._done.clear()
            self._watched = self._rounds[index]
        self._acc = 1 - index
        self._sums[self._acc].zero_()
        self._in_flight, self._known_done = True, False
        self._posted_at = time.perf_counter()
        self._stalled = False
        self._round_samples = self._round_batches = self._timed_samples = 0
        self._timed_s = 0.0
        self.rounds += 1

    def _complete_in_flight(self, what: str, *, unless_peer_closed: bool = False) -> None:
        """Wait (watchdogged) until the round in flight has completed; it stays to be applied.

        ``unless_peer_closed``: stop waiting, the round still in flight, once another rank
        has reached ``close()``: it will post no further round. Otherwise the round's sum is
        in its buffer on return (a node-shared or staged one reaches it only through ``wait``).
        """
        if not self._in_flight:
            return
        closings = self._closings
        if unless_peer_closed and closings is not None:
            if not self._known_done:
                stall_at = self._posted_at + self._stall_s()
                self.comm.wait_for(
                    lambda: self._completed() or closings.peer_closed() or time.perf_counter() > stall_at, what
                )
                self._stalled = not self._known_done and not closings.peer_closed()
            return
        with self._watch_lock:  # no other thread or wait tests the round from here on
            self._watched = None
        self._rounds[1 - self._acc].wait(what)
        self._known_done = True

    def _stall_s(self) -> float:
        """How long a round may be in flight before a bounded wait for it ends (:data:`STALL_ROUNDS`)."""
        if not self._durations:
            return STALL_FIRST_S
        return max(STALL_MIN_S, STALL_ROUNDS * min(self._durations))

    # --------------------------------------------------------------- lifecycle
    @property
    def node_shared(self) -> bool:
        return self._drives_waits

    def _free(self) -> None:
        """Collective: complete every round in flight, keep the ranks' models equal, free MPI resources.

        Ranks may stop one round apart (a rank posts round k + 1 once round k completed,
        and may stop before the others saw it). Every rank learns the newest round
        posted; a rank one behind applies its completed round as the others did and joins
        the newest round with an empty contribution. The newest round, which no rank has
        applied, is dropped: the micro-batches computed in it are not applied.
        """
        if self._thread is not None:
            self._thread.stop()
        if self._closings is not None:  # announced first: a rank waiting in a bounded round stops waiting
            self._closings.close(self.rounds, entered=False, busy=self._in_flight)
        if self.alone:  # every round applied in its step: nothing in flight, nothing to free
            return
        rounds = torch.tensor([float(self.rounds)], dtype=torch.float64)
        newest = int(self._control.allreduce_(rounds, "max", what="abs-sgd close").item())
        self._complete_in_flight("abs-sgd round at close")
        if self.rounds < newest:
            if self._in_flight:
                self._finish_round()
            self._sums[self._acc].zero_()
            self._round_samples = self._round_batches = 0
            self._post()
            self._complete_in_flight("abs-sgd closing round")
        if self._drives_waits:
            self.comm.interrupts.remove(self._watch)
        for round_ in self._rounds:
            round_.free()
        if self._weights is not None:
            self._hold_true_weights()  # the user's model ends at the true weights

    def state_dict(self) -> dict[str, Any]:
        """Collective (every rank at the same applied update, as the trainer checkpoints).

        The round in flight is completed first and saved reduced, not yet applied, with
        this round's own sums so far: a solver that loads the state is where this one
        is, and the next ``step`` of either applies that round.
        """
        self._complete_in_flight("abs-sgd round at checkpoint")
        return {
            **super().state_dict(),
            "rounds": self.rounds,
            "updates": self.updates,
            "reference_batch": self.reference_batch,
            "batch_sizes": self.batch_sizes,
            "accumulating": self._sums[self._acc][: self._numel].clone() if self._sums else self._no_sums(),
            "round_samples": self._round_samples,
            "round_batches": self._round_batches,
            "completed": self._sums[1 - self._acc].clone() if self._in_flight else None,  # with its speeds
            "speeds": [list(speeds) for speeds in self._speeds],
            "timed": (self._timed_samples, self._timed_s),
            "carry": self._carry.clone() if self._carry is not None else None,
            # The model's own state holds the predicted weights; these are the true ones.
            "weights": self._weights.flat.clone() if self._weights is not None else self._true_weights(),
            "last_update": self._last_update.flat.clone() if self._last_update is not None else self._no_update(),
        }

    def _no_sums(self) -> torch.Tensor:
        """Alone: a round's sums as several ranks save them, with nothing accumulated (zeros)."""
        return torch.zeros(self._numel, dtype=self._wire, device=self.params[0].device)

    def _true_weights(self) -> torch.Tensor | None:
        """Alone with weight prediction asked for: the model's weights are the true ones (saved for several ranks)."""
        if not self.alone or self.options.weight_prediction == 0:
            return None
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def _no_update(self) -> torch.Tensor | None:
        """Alone with weight prediction asked for: no last update to predict from (zeros)."""
        weights = self._true_weights()
        return None if weights is None else torch.zeros_like(weights)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Collective: a round in flight here is completed and replaced by the state's."""
        super().load_state_dict(state)
        if self.alone and state["completed"] is not None:
            raise ValueError(
                "this abs-sgd state holds a round in flight (saved at several ranks): abs-sgd at one rank applies "
                "each micro-batch in its own step; resume it at several ranks"
            )
        self._complete_in_flight("abs-sgd round before loading a state")
        self._acc = 0
        if self._sums:  # alone: the step applies each micro-batch, and a round accumulates nothing
            self._sums[0].zero_()
            self._sums[0][: self._numel].copy_(state["accumulating"])
        self._round_samples = int(state["round_samples"])
        self._round_batches = int(state["round_batches"])
        completed = state["completed"]
        self._in_flight = self._known_done = completed is not None
        if completed is not None:
            self._sums[1].copy_(completed)
        if self._carry is not None:
            self._carry.copy_(state["carry"])
        if self.alone and state.get("weights") is not None:  # the model's state holds the predicted ones
            with torch.no_grad():
                offset = 0
                for p in self.params:
                    p.copy_(state["weights"][offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        if self._weights is not None:
            if state.get("weights") is None:
                raise ValueError(
                    "this abs-sgd state was saved without weight prediction; load it with weight_prediction=0"
                )
            assert self._last_update is not None  # built with _weights
            self._weights.flat.copy_(state["weights"])
            self._last_update.flat.copy_(state["last_update"])
        self.rounds = int(state["rounds"])
        self.updates = int(state["updates"])
        reference = state["reference_batch"]
        self.reference_batch = None if reference is None else float(reference)
        self.batch_sizes = None if state["batch_sizes"] is None else list(state["batch_sizes"])
        self._speeds.clear()
        self._speeds.extend(state["speeds"])
        self._timed_samples, self._timed_s = state["timed"]
