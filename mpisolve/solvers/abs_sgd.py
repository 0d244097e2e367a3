"""ABS-SGD: delayed synchronous SGD with an adaptive batch size (Zhou, Chen, Wu, 2023; reconstructed).

Per worker, round after round::

    post a nonblocking allreduce of (G, n)          # summed gradients and sample count of the last round
    G, n = 0, 0
    repeat: one micro-batch at the current w; G += its summed gradient; n += its size
    until that allreduce has completed              # at least one micro-batch per round
    w <- w - lr * (sum over ranks of the last round's G) / (sum of its n)

A collective completes only once every rank has joined it, so the slowest worker paces
the rounds while the faster ones fill the wait with more micro-batches: nobody idles,
the global batch adapts every round, and the update is the sample-weighted mean of
gradients one round old. Every rank applies the same rounds in the same order with the
same global sample count: the solver is lockstep.

In the user's loop this is one ``step()`` per micro-batch: it adds the micro-batch to the
round's sums, tests the previous round's allreduce (which is what moves it along between
micro-batches), and when that has completed applies its mean through the user's
optimizer, posts this round's sums and starts a new round. Two fused buffers alternate
(one accumulating, one in flight), each with its own persistent allreduce, so a round's
gradients are never allocated or copied (the adaptive split reads ranks + 1 numbers back).

The paper's full text was not available: the rule above is reconstructed from its
abstract (README, ABS-SGD), and its open choices are the options below.

The one-round delay is compensated by weight prediction (``weight_prediction``, on by
default): a round's micro-batches compute their gradients at the weights predicted for
when the round will be applied, ``w + c (w - w_before_last_update)``, rather than at
``w``. Uncompensated, a gradient one update old under heavy-ball momentum ``beta`` is
stable only for ``lr * curvature < 1 - beta`` (instead of ``2 (1 + beta)``), which on the
study's MLP doubled the updates to a target accuracy; predicted weights give back about
sync SGD's count (README, ABS-SGD study). The model holds the predicted weights while it
trains; :meth:`ABSSGD.evaluating`, ``close`` and checkpoints keep the true ones.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.amp import GradScaler

from ..comm.buckets import FusedBuffer, wire_dtype
from ..comm.communicator import CommTimeout
from ..comm.progress import ProgressThread, require_async_progress
from ..options import require
from .base import Solver, StepInfo, register
from .lb_bsp import measure_speeds, proportional_batches
from .nonfinite import all_finite

Trigger = Literal["collective", "window", "samples"]
LRScaling = Literal["none", "linear", "sqrt"]
ProgressMode = Literal["poll", "thread", "mpich"]
MicroBatch = Literal["adaptive", "speed", "fixed"]

#: Rounds of measured speeds whose per-rank median sets the adaptive split.
SPEED_ROUNDS = 3


@dataclass(frozen=True, kw_only=True)
class ABSSGDOptions:
    """When a round ends, how the learning rate follows the global batch, who moves MPI along,
    how large each rank's micro-batches are.

    ``trigger``: ``"collective"`` (default): a round ends at the first micro-batch after
    the previous round's allreduce completed, the paper's rule, with nothing to tune.
    ``"window"``: also not before the round has lasted ``window_s`` seconds on this rank
    (fewer, larger updates: for communication-bound models). ``"samples"``: a completed
    round whose global count, with any rounds carried before it, is below
    ``min_samples`` is carried into the next instead of applied (a global batch of at
    least ``min_samples``, as Hivemind's target batch size).

    ``lr_scaling``: ``"none"`` (default): the update is the sample-weighted mean at the
    optimizer's learning rate, as the rule is written, which keeps the comparison with
    synchronous SGD at one learning rate. ``"linear"`` / ``"sqrt"``: each update's
    learning rate is multiplied by ``N / reference_batch`` (or its square root), N being
    the update's global sample count; ``reference_batch`` defaults to the first update's
    count (every rank's first micro-batch: the global batch synchronous SGD would use).

    ``progress``: ``"thread"`` (default): a thread of ours tests the allreduce every
    ``progress_ms`` (default 1) while the rank computes (needs ``MPI_THREAD_MULTIPLE``,
    mpi4py's default). MPICH runs a large allreduce in stages, each started by a test, so
    the interval sets the round's length: a 4.4 MB allreduce at 4 ranks completed 54 ms
    after it started testing every 5 ms, 14 ms testing every 1 ms, and the study's rounds
    went from 1.8 micro-batches to 1.05. Each test takes the GIL and enters MPI, CPU the
    rank's own work lacks when ranks share cores (the study's MLP, 4 ranks on 2 cores:
    300 samples/s at 1 ms, 325 at 5 ms); on a GPU node that CPU is idle. ``"poll"``:
    the allreduce moves only when ``step`` tests it, between micro-batches: no thread, but
    a large allreduce runs in several stages (MPICH's ring for big messages), each waiting
    for the slowest rank's next test, so a round lasts several of its micro-batches (an
    MLP of 1.1 M parameters with a 4x straggler: 2 updates in 2 epochs under ``"poll"``,
    10 under ``"thread"``). ``"mpich"``: MPICH's own progress thread (launch with
    ``MPICH_ASYNC_PROGRESS=1``, refused otherwise; it busy-polls a core).

    ``micro_batch`` (what a training loop gets from :meth:`ABSSGD.local_batch_size`):
    ``"speed"``: the ranks split ``ranks * configured`` samples by their speeds (measured
    with the loop's probe, ``measure_batches`` timed micro-batches), as ``lb-bsp`` splits
    its batch, so every rank's micro-batch takes about as long: the slowest rank, which
    paces the rounds, ends a round after a short micro-batch instead of a long one (the
    paper computes "without specifying batch size in advance"), and one micro-batch per
    rank holds the global batch synchronous SGD would use, so one learning rate means the
    same to both. ``"adaptive"`` (default): that split, then split again whenever the
    speeds change: every rank times its own micro-batches (from the first training
    forward after a ``step`` to the next ``step``: forward, backward, whatever the loop
    does between them, not evaluations or checkpoints) and sends its speed with the
    round's sums, so every rank learns every speed with no collective of its own and
    computes the same split, from the median of each rank's last ``SPEED_ROUNDS`` rounds
    (one slow round does not move it). A step that changes this rank's size says so in
    ``StepInfo.next_batch_size``, which the loop follows (a loop that does not keeps its
    size; the weighting by samples stays exact). Speeds measured once go stale when load
    moves between nodes; these do not. ``"fixed"``: every rank uses the configured size.

    ``weight_prediction`` (``c``, default 1): micro-batches compute gradients at
    ``w + c * (last update)``, the weights their round's update will be applied to if the
    next update repeats the last one (the delay compensation above; SpecTrain's weight
    prediction, Chen et al. 2018). ``0``: at ``w``, the rule as written.
    """

    trigger: Trigger = "collective"
    window_s: float | None = None
    min_samples: int | None = None
    lr_scaling: LRScaling = "none"
    reference_batch: int | None = None
    progress: ProgressMode = "thread"
    progress_ms: float = 1.0
    micro_batch: MicroBatch = "adaptive"
    measure_batches: int = 3
    weight_prediction: float = 1.0

    def __post_init__(self) -> None:
        require(
            math.isfinite(self.progress_ms) and self.progress_ms > 0, f"progress_ms must be > 0, got {self.progress_ms}"
        )
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
            self.reference_batch is None or self.lr_scaling != "none",
            "reference_batch is used by lr_scaling='linear' or 'sqrt' only",
        )
        require(
            self.reference_batch is None or self.reference_batch >= 1,
            f"reference_batch must be >= 1, got {self.reference_batch}",
        )
        require(self.measure_batches >= 1, f"measure_batches must be >= 1, got {self.measure_batches}")
        require(
            math.isfinite(self.weight_prediction) and self.weight_prediction >= 0,
            f"weight_prediction must be a finite number >= 0, got {self.weight_prediction}",
        )


@register
class ABSSGD(Solver):
    """Delayed synchronous SGD with an adaptive batch size: no worker waits for another."""

    name = "abs-sgd"
    Options = ABSSGDOptions
    #: A rank may stop rounds before the others: ``close`` lets it catch up (see there).
    tolerates_uneven = True

    def setup(self) -> None:
        if self.options.progress != "poll":
            require_async_progress(self.options.progress)
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) != 1:
            raise TypeError(
                f"abs-sgd needs trainable parameters of one dtype on one device, got {sorted(map(str, kinds))}"
            )
        dtype, device = kinds.pop()
        # p.grad are views into one flat buffer: a micro-batch joins the round in one add.
        self.grads = FusedBuffer([p.shape for p in self.params], dtype, device)
        self._point_grads_at_views()
        wire = wire_dtype(dtype)
        numel = self._numel = self.grads.numel
        #: Two rounds' sums, one accumulating, one in flight: the gradients, the sample count, then
        #: one slot per rank for its measured speed (a sum of one nonzero term: exact everywhere).
        self._sums = [torch.zeros(numel + 1 + self.comm.size, dtype=wire, device=device) for _ in range(2)]
        self._rounds = [self.comm.persistent_allreduce(s) for s in self._sums]
        self._carry = torch.zeros(numel + 1, dtype=wire, device=device) if self.options.trigger == "samples" else None
        shapes = self.grads.shapes
        #: With weight prediction: the true weights (the model holds the predicted ones) and the last update.
        self._weights = self._last_update = None
        if self.options.weight_prediction > 0:
            self._weights = FusedBuffer(shapes, dtype, device)
            self._weights.pack([p.detach() for p in self.params])
            self._last_update = FusedBuffer(shapes, dtype, device)
        self._control = self.comm.split(0, name="abs-sgd close")  # close()'s agreement, apart from the rounds
        self._acc = 0  # index of the accumulating buffer; the other one is in flight
        self._in_flight = False  # a posted round not yet applied (or carried)
        self._known_done = False  # ... whose allreduce is known to have completed
        self._posted_at = 0.0
        self._round_samples = 0
        # This round's timed micro-batches: each from its first training forward to its step.
        self._timed_samples = 0
        self._timed_s = 0.0
        #: The last rounds' speeds of every rank (samples/s), the same on every rank.
        self._speeds: deque[list[float]] = deque(maxlen=SPEED_ROUNDS)
        self._next_batch_size: int | None = None
        #: Rounds this rank has posted, updates it has applied.
        self.rounds = 0
        self.updates = 0
        self.reference_batch: float | None = self.options.reference_batch
        #: Every rank's micro-batch size, once ``local_batch_size`` decided it by speed (and as re-split).
        self.batch_sizes: list[int] | None = None
        self._watch_lock = threading.Lock()
        self._watched: Any = None  # the PersistentAllreduce the progress thread tests
        self._done = threading.Event()
        interval_s = self.options.progress_ms / 1e3
        self._thread = (
            ProgressThread(self._watch, name="mpisolve-abs-sgd-progress", interval_s=interval_s)
            if self.options.progress == "thread"
            else None
        )

    def local_batch_size(self, configured: int, probe: Callable[[int], float] | None = None) -> int:
        """This rank's micro-batch: ``configured``, or by speed (collective, the first time; see the options)."""
        if self.options.micro_batch == "fixed":
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
        """Zero this micro-batch's gradients (one fill of the flat buffer)."""
        self.grads.flat.zero_()
        self._point_grads_at_views()

    # -------------------------------------------------------------------- step
    def step(self, batch_size: int | None = None, *, scaler: GradScaler | None = None) -> StepInfo:
        """Add this micro-batch to the round; apply last round's mean if its allreduce has completed.

        ``scaler``: the micro-batch's gradients are unscaled; a non-finite micro-batch is left
        out of the round (the scaler's skip); the rounds go on as usual.
        """
        if self.closed:
            raise RuntimeError("solver 'abs-sgd' is closed")
        started_at = self._forward_at  # this micro-batch's first training forward
        n = self.take_samples(batch_size)
        if n == 0:  # no micro-batch: nothing to add, and a round needs one
            self._end_step()
            return StepInfo(applied=False, global_samples=0, local_samples=0)
        if started_at is not None:
            self._timed_s += time.perf_counter() - started_at
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
        if self._in_flight and not self._round_over():
            return StepInfo(applied=False, global_samples=0, local_samples=n)
        applied, samples = self._finish_round() if self._in_flight else (False, 0)
        self._post()
        resized, self._next_batch_size = self._next_batch_size, None
        return StepInfo(applied=applied, global_samples=samples, local_samples=n, next_batch_size=resized)

    def _round_over(self) -> bool:
        """Whether the round in flight has completed and this rank's round may end."""
        if not self._completed():
            if time.perf_counter() - self._posted_at > self.comm.timeout_s:
                raise CommTimeout(
                    f"mpisolve: abs-sgd round {self.rounds - 1} did not complete within {self.comm.timeout_s:g} s "
                    f"on rank {self.comm.rank} of {self.comm.size} (watchdog; set MPISOLVE_TIMEOUT to change it)"
                )
            return False
        if self.options.trigger == "window":
            return time.perf_counter() - self._posted_at >= self.options.window_s
        return True

    def _completed(self) -> bool:
        if self._known_done:
            return True
        if self._thread is not None:
            done = self._done.is_set()
        else:
            done = self._rounds[1 - self._acc].test()
        self._known_done = done
        return done

    def _watch(self) -> None:
        """The progress thread's poke: test the round in flight; say when it completed."""
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
        if self.options.micro_batch == "adaptive" and self.batch_sizes is not None:
            self._resplit(self._sums[index][self._numel + 1 :].tolist())
        reduced = self._sums[index][: self._numel + 1]
        if self._carry is not None:
            reduced = self._carry.add_(reduced)
        total = int(round(reduced[-1].item()))
        if self._carry is not None and total < self.options.min_samples:
            return False, 0
        if total == 0:  # an empty round (only from close): nothing to apply
            return False, 0
        torch.mul(reduced[:-1], 1.0 / total, out=self.grads.flat)
        # The round's mean is the same everywhere: every rank decides alike, unasked.
        if not self.nonfinite.ok([self.grads.flat], "round's mean gradients"):
            if self._carry is not None:
                self._carry.zero_()
            return False, 0
        self._optimizer_step(total)
        if self._carry is not None:
            self._carry.zero_()
        self.updates += 1
        return True, total

    def _resplit(self, speeds: list[float]) -> None:
        """Split the batch again by every rank's recent speed (the same on every rank)."""
        assert self.batch_sizes is not None  # called once local_batch_size has split the batch
        if min(speeds) <= 0:
            return  # a rank timed nothing this round
        self._speeds.append(speeds)
        recent = tuple(statistics.median(rank_speeds) for rank_speeds in zip(*self._speeds))
        sizes = proportional_batches(recent, sum(self.batch_sizes))
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
    def evaluating(self) -> Iterator[torch.nn.Module]:
        """The model holds the true weights for the duration (not the predicted ones it trains at)."""
        if self._weights is None or self.closed:
            yield self.model
            return
        self._hold_true_weights()
        try:
            yield self.model
        finally:
            self._hold_predicted_weights()

    def _scaled_step(self, global_samples: int) -> None:
        scaling = self.options.lr_scaling
        if scaling == "none":
            self.optimizer.step()
            return
        if self.reference_batch is None:
            self.reference_batch = float(global_samples)
        ratio = global_samples / self.reference_batch
        factor = ratio if scaling == "linear" else math.sqrt(ratio)
        groups = self.optimizer.param_groups
        base = [group["lr"] for group in groups]
        for group, lr in zip(groups, base):
            group["lr"] = lr * factor
        try:
            self.optimizer.step()
        finally:
            for group, lr in zip(groups, base):
                group["lr"] = lr

    def _post(self) -> None:
        """Start this round's allreduce and a new round in the other buffer."""
        index = self._acc
        sums, count_at = self._sums[index], self._numel
        sums[count_at].fill_(self._round_samples)
        sums[count_at + 1 + self.comm.rank].fill_(self._timed_samples / self._timed_s if self._timed_s > 0 else 0.0)
        self._rounds[index].start()
        if self._thread is not None:
            with self._watch_lock:
                self._done.clear()
                self._watched = self._rounds[index]
        self._acc = 1 - index
        self._sums[self._acc].zero_()
        self._in_flight, self._known_done = True, False
        self._posted_at = time.perf_counter()
        self._round_samples = self._timed_samples = 0
        self._timed_s = 0.0
        self.rounds += 1

    def _complete_in_flight(self, what: str) -> None:
        """Wait (watchdogged) until the round in flight has completed; it stays to be applied."""
        if not self._in_flight or self._known_done:
            return
        if self._thread is not None:
            with self._watch_lock:  # the thread no longer touches the request
                self._watched = None
        self._rounds[1 - self._acc].wait(what)
        self._known_done = True

    # --------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Collective: complete every round in flight, keep the ranks' models equal, free MPI resources.

        Ranks may stop one round apart (a rank posts round k + 1 once round k completed,
        and may stop before the others saw it). Every rank learns the newest round
        posted; a rank one behind applies its completed round as the others did and joins
        the newest round with an empty contribution. The newest round, which no rank has
        applied, is dropped: the micro-batches computed in it are not applied.
        """
        if self.closed:
            return
        if self._thread is not None:
            self._thread.stop()
        rounds = torch.tensor([float(self.rounds)], dtype=torch.float64)
        newest = int(self._control.allreduce_(rounds, "max", what="abs-sgd close").item())
        self._complete_in_flight("abs-sgd round at close")
        if self.rounds < newest:
            if self._in_flight:
                self._finish_round()
            self._sums[self._acc].zero_()
            self._round_samples = 0
            self._post()
            self._complete_in_flight("abs-sgd closing round")
        for round_ in self._rounds:
            round_.free()
        if self._weights is not None:
            self._hold_true_weights()  # the user's model ends at the true weights
        super().close()

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
            "accumulating": self._sums[self._acc][: self._numel].clone(),
            "round_samples": self._round_samples,
            "completed": self._sums[1 - self._acc].clone() if self._in_flight else None,  # with its speeds
            "speeds": [list(speeds) for speeds in self._speeds],
            "timed": (self._timed_samples, self._timed_s),
            "carry": self._carry.clone() if self._carry is not None else None,
            # The model's own state holds the predicted weights; these are the true ones.
            "weights": self._weights.flat.clone() if self._weights is not None else None,
            "last_update": self._last_update.flat.clone() if self._last_update is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Collective: a round in flight here is completed and replaced by the state's."""
        super().load_state_dict(state)
        self._complete_in_flight("abs-sgd round before loading a state")
        self._acc = 0
        self._sums[0].zero_()
        self._sums[0][: self._numel].copy_(state["accumulating"])
        self._round_samples = int(state["round_samples"])
        completed = state["completed"]
        self._in_flight = self._known_done = completed is not None
        if completed is not None:
            self._sums[1].copy_(completed)
        if self._carry is not None:
            self._carry.copy_(state["carry"])
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
