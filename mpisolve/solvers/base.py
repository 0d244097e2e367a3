"""The one solver interface, its options, and the registry every entry point reads.

A solver holds the user's model and optimizer (composition, never a subclass) and is
driven from the user's own loop::

    solver = mpisolve.make_solver("allreduce", model, optimizer, bucket_mb=25)
    with solver.join():                 # ranks whose data runs out early wait for the others
        for x, y in loader:
            solver.zero_grad()          # or optimizer.zero_grad(), model.zero_grad(), ...
            loss_fn(model(x), y).backward()
            info = solver.step()        # StepInfo: was an update applied, on how many samples
    solver.close()

The step API, the same for every solver: :meth:`Solver.no_sync` (gradient accumulation),
:meth:`Solver.synchronize` (reduce now: clip, unscale or inspect the gradients, then
``step`` applies them), ``step(scaler=...)`` (a ``torch.amp.GradScaler``), and
:meth:`Solver.join` (uneven inputs). The gradient-bucket mechanics behind them live in
:class:`~mpisolve.comm.buckets.GradientBuckets`; docs/guide/your-loop.md has the recipes.

Options are keyword-only, declared as a frozen dataclass per solver and validated when
the solver is built; the CLI's ``--set key=value`` is parsed from the same declaration.
Every solver also takes :class:`CommonOptions` (``nonfinite``); the synchronous ones
:class:`SynchronousOptions` (``broadcast_buffers``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar, cast

import torch
from mpi4py import MPI
from torch.amp import GradScaler

from ..comm.buckets import GradientBuckets, Reduction
from ..comm.closing import CloseNotices
from ..comm.communicator import Communicator, as_communicator
from ..comm.state import BufferBroadcast, broadcast_module_and_optimizer, check_same_model
from ..errors import OptionError, UnevenSteps
from ..options import Options, build_options, option, options_to_dict
from .nonfinite import NonFiniteGuard, NonFinitePolicy, all_finite

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class StepInfo:
    """What one call of ``Solver.step`` did.

    ``applied``: an update reached the model (False when the step was skipped: a
    GradScaler's skip of a non-finite step, ``nonfinite="skip"``, or a round no rank
    contributed to). ``global_samples``: samples the applied update covers over all
    ranks (0 when none was applied); under :meth:`Solver.join`, only the ranks still in
    their loops count. ``local_samples``: this rank's samples consumed by this step
    (every micro-batch since the last step, with ``no_sync``). ``next_batch_size``: the
    micro-batch size this rank should draw from now on, when the solver has just changed
    it (a solver that re-splits the batch by speed as it goes); None: keep the one you have.
    """

    applied: bool
    global_samples: int
    local_samples: int
    next_batch_size: int | None = None


@dataclass
class Joined:
    """What ``with solver.join() as joined:`` tells once the block is over.

    ``last_rank``: the rank whose loop ended last (of several that ended in the same
    step, the highest, as DDP's ``Join``), whose model and optimizer state every rank
    then holds; None inside the block, and for the solvers whose ranks stop apart
    (``join()`` does nothing there). A loop's own objects (a learning-rate scheduler, a
    GradScaler, counters) are the user's: re-sync them from this rank if they must agree.
    """

    last_rank: int | None = None


@dataclass(frozen=True, kw_only=True)
class CommonOptions(Options):
    """Options every solver takes.

    Every solver's options dataclass derives from this one (see
    :mod:`mpisolve.solvers.nonfinite`).
    """

    nonfinite: NonFinitePolicy = option(
        "raise",
        "a step whose gradients or update hold a NaN or Inf: raise an error, skip it on every rank alike "
        "(counted; an error after 100 in a row), or do not check (ignore)",
    )


@dataclass(frozen=True, kw_only=True)
class SynchronousOptions(CommonOptions):
    """Options of the solvers whose ranks hold one model (allreduce, adasum, lb-bsp, kfac).

    ``broadcast_buffers``: one nonblocking broadcast of rank 0's buffers is started after
    each step and completed before they are next read (the next forward, an evaluation,
    ``close``); see docs/guide/your-loop.md for SyncBatchNorm-style alternatives.
    """

    broadcast_buffers: bool = option(
        True,
        "rank 0's module buffers (BatchNorm running statistics) on every rank from each forward on, as DDP's "
        "default; false: each rank keeps the statistics of its own data",
    )


def collective_round(method: F) -> F:
    """Mark a method whose waits belong to the solver's current collective round.

    Only there does another rank's ``close()`` interrupt a wait. ``step`` and ``synchronize`` are rounds
    already where :attr:`Solver.round_per_step` says so; mark the methods that run a round
    every few steps (an average, an exchange).
    """

    @functools.wraps(method)
    def in_round(self: Solver, *args: Any, **kwargs: Any) -> Any:
        with self._collective_round():
            return method(self, *args, **kwargs)

    return cast(F, in_round)


#: A solver's options dataclass.
OptionsT = TypeVar("OptionsT", bound=CommonOptions)


class Solver(ABC, Generic[OptionsT]):
    """The interface every mpisolve solver implements, generic in its options dataclass ``OptionsT``."""

    name: ClassVar[str]
    #: The solver's options dataclass (``OptionsT``): it derives from :class:`CommonOptions`.
    Options: ClassVar[type[CommonOptions]] = CommonOptions
    #: True when every rank's ``step`` returns the same sequence of applied updates with
    #: the same ``global_samples`` (counted over all ranks): synchronous rounds, or
    #: ABS-SGD's delayed rounds, however many micro-batches each rank computes per round.
    #: A training loop can then decide when to stop or evaluate from its own counts, with
    #: no extra communication. False for asynchronous solvers, whose ``global_samples``
    #: count only this rank's contribution: the loop agrees on progress by summing them.
    lockstep: ClassVar[bool] = True
    #: True when ranks may stop at different steps with no help (ABS-SGD, the asynchronous
    #: solvers): ``join()`` changes nothing. False: each step (or average, exchange) is a
    #: collective round every rank must take; ``join()`` lets ranks that run out early take
    #: part contributing nothing, and without it ``close()`` reports the unevenness.
    tolerates_uneven: ClassVar[bool] = False
    #: What a collective round of this solver is called in messages.
    round_unit: ClassVar[str] = "steps"
    #: True when every ``step`` (and ``synchronize``) is one collective round; False for solvers
    #: whose rounds come every few steps (they mark those methods :func:`collective_round`) or
    #: that have none the ranks take together.
    round_per_step: ClassVar[bool] = True
    #: Whether ``join()`` ends by giving every rank the model (parameters and buffers) and the
    #: optimizer state of the last rank to join, as DDP's ``Join`` gives its model: False where
    #: the ranks' models differ by design (EASGD's workers; its result is the center).
    joins_to_one_model: ClassVar[bool] = True

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        comm: MPI.Comm | Communicator | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.options: OptionsT = cast(OptionsT, build_options(self.name, self.Options, options))
        # The solver's own communicator (a duplicate of the one given): its collectives never
        # interleave with the user's or another solver's, whatever order those come in.
        self.comm = as_communicator(comm).dup()
        self.model = model
        self.optimizer = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        check_same_model(model, self.comm)
        broadcast_module_and_optimizer(model, optimizer, self.comm)
        #: Checks updates for NaN/Inf before they reach the model (``nonfinite`` option).
        self.nonfinite = NonFiniteGuard(self.options.nonfinite, self.comm, self.name)
        self._samples = 0
        #: When the first training forward since the last step began (by ``_clock``), or None.
        self._forward_at: float | None = None
        #: The clock of ``_forward_at`` (a solver that times its ranks' speeds sets :func:`.speeds.rank_clock`).
        self._clock: Callable[[], float] = time.perf_counter
        #: Collective rounds (steps; averages or exchanges for the local-step solvers) completed.
        self.rounds = 0
        self._round_open = False  # a step (synchronize, join's round) is running: its waits may be interrupted
        self._round_entered = False  # this round's step was entered (and may have ended in an error)
        self._joining = False
        self._evaluating = 0  # evaluating() contexts open: their forwards are not training ones
        self._active_ranks = 0  # ranks still in their loops in the last round (join ends after one with none)
        self._unscaled_by: GradScaler | None = None
        #: The GradScaler the last step was given: a rank that joined decides its shadow steps as with it.
        self._scaler: GradScaler | None = None
        self._shadowing = False  # a joined rank's step: it decides as the others, and applies nothing
        self._verdict: str | None = None
        buffers = [b for b in model.buffers() if b.numel() > 0]
        self._buffers: BufferBroadcast | None = None
        synchronous = isinstance(self.options, SynchronousOptions) and self.options.broadcast_buffers
        if synchronous and buffers and self.comm.size > 1:
            self._buffers = BufferBroadcast(buffers, self.comm)
        self._notices: CloseNotices | None = None
        if not self.tolerates_uneven and self.comm.size > 1:
            self._notices = CloseNotices(self.comm, self._round_waiting, self.name, self.round_unit)
        # Eager under torch.compile too (a graph break): it may wait for the buffers' broadcast.
        self._sample_hook = model.register_forward_pre_hook(torch.compiler.disable(self._count_samples))
        self._stepping = False  # the solver is stepping the optimizer (any other step is the user's own)
        self._step_hook = optimizer.register_step_pre_hook(self._refuse_direct_step)
        self.closed = False
        self.setup()

    @abstractmethod
    def setup(self) -> None:
        """Build the solver's own state; called once, at the end of construction.

        By then ``options``, ``comm``, ``model``, ``optimizer`` and ``params`` are set and
        the ranks' models are checked equal and synchronised. Every solver implements this
        rather than overriding ``__init__``, so every solver is built by the same signature.
        """

    # ------------------------------------------------------------- samples
    def _count_samples(self, module: torch.nn.Module, args: tuple) -> None:
        if self._buffers is not None and self._buffers.pending:
            self._buffers.complete()  # the last step's broadcast of rank 0's buffers, before they are read
        if not self._training_forward(module):
            return
        if self._forward_at is None:
            self._forward_at = self._clock()
        if args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:
            self._samples += args[0].shape[0]

    def _training_forward(self, module: torch.nn.Module) -> bool:
        """Whether a forward of ``module`` now is a training one.

        A training forward counts its samples (and K-FAC's factors): autograd on (not under
        ``no_grad`` or ``inference_mode``), the model in training mode (not after
        ``model.eval()``), outside :meth:`evaluating`.
        """
        return torch.is_grad_enabled() and module.training and not self._evaluating

    @property
    def node_shared(self) -> bool:
        """Whether this rank's gradient sums run in node-shared memory (:mod:`mpisolve.comm.shm`), not by MPI alone."""
        return False

    def samples_seen(self) -> int:
        """Samples the training forward passes (:meth:`_training_forward`) have seen since the last step."""
        return self._samples

    def take_samples(self, batch_size: int | None) -> int:
        """This step's local sample count: ``batch_size`` if given, else what forward saw."""
        n = self._samples if batch_size is None else batch_size
        self._samples, self._forward_at = 0, None
        if n < 0:
            raise ValueError(f"batch_size must be >= 0, got {n}")
        return n

    # ----------------------------------------------------------- interface
    def local_batch_size(self, configured: int, probe: Callable[[int], float] | None = None) -> int:
        """This rank's micro-batch size.

        A training loop asks once, on every rank, before drawing data (and follows
        ``StepInfo.next_batch_size`` when a step changes it).

        ``configured``: the batch size the run was given. ``probe(n)``: the seconds one
        training micro-batch of ``n`` samples takes on this rank (forward, backward and any
        emulated slowdown), for solvers that size batches by speed. By default: ``configured``.
        """
        return configured

    def zero_grad(self) -> None:
        """Clear this rank's gradients before the next backward (any other way of zeroing works too).

        Torch's default, set to None, so that backward writes them afresh instead of adding to zeros.
        """
        self.optimizer.zero_grad()

    def step(self, batch_size: int | None = None, *, scaler: GradScaler | None = None) -> StepInfo:
        """Combine work across ranks and maybe update the model.

        ``batch_size``: this rank's samples since the last step, when the model's first
        input is not batch-first; by default it is read from the forward passes.
        ``scaler``: a ``torch.amp.GradScaler`` whose ``scaler.scale(loss)`` the backward
        passes used: the step unscales the gradients (unless :meth:`synchronize` did),
        skips itself when they are not finite (``StepInfo.applied`` False: the scaler's
        normal skip, not an error) and steps through ``scaler.step``; call
        ``scaler.update()`` after it. Do not call ``scaler.unscale_`` or ``scaler.step``
        yourself.

        Refused on a closed solver; a collective round where :attr:`round_per_step`; the
        solver's own work is :meth:`_step`.
        """
        self._check_open("step")
        if not self.round_per_step:
            return self._step(batch_size, scaler)
        with self._collective_round():
            return self._step(batch_size, scaler)

    @abstractmethod
    def _step(self, batch_size: int | None, scaler: GradScaler | None) -> StepInfo:
        """The solver's step (the hook :meth:`step` calls once the solver is known open).

        It ends each collective round it completes with :meth:`_end_round` (the buffers'
        broadcast starts, the round is counted) and a step that completes none with
        :meth:`_end_step`; :meth:`_bucket_step` does all of it for a solver of gradient buckets.
        """

    def no_sync(self) -> AbstractContextManager[None]:
        """Gradient accumulation: backward passes inside only accumulate gradients locally.

        Run every micro-batch's backward but the last inside ``with solver.no_sync():``,
        the last outside, then ``step()``: one update on all the micro-batches' samples
        (divide each micro-batch's loss by their number for the mean, as with DDP). This
        solver communicates nothing during backward, so the context changes nothing here
        (a second backward accumulates all the same).
        """
        return nullcontext()

    def synchronize(self, *, scaler: GradScaler | None = None) -> None:
        """Complete this step's combination of gradients now.

        The next ``step()`` applies them without communicating them again.

        After it, ``p.grad`` holds what the step applies (the averaged or combined
        gradients; this rank's own for solvers that step on local gradients), to clip or
        inspect. ``scaler``: also unscale them (the ranks' reduced gradients are equal,
        so every rank decides alike whether to skip). Call it on every rank.
        """
        self._check_open("synchronize")
        if not self.round_per_step:
            self._synchronize(scaler)
            return
        with self._collective_round():
            self._synchronize(scaler)

    def _synchronize(self, scaler: GradScaler | None) -> None:
        """The solver's :meth:`synchronize`; by default the gradients stay this rank's own, unscaled."""
        self._unscale(scaler)

    def _check_open(self, call: str) -> None:
        if self.closed:
            raise RuntimeError(f"mpisolve {self.name}: {call}() on a closed solver (close() was called)")

    @contextmanager
    def _collective_round(self) -> Iterator[None]:
        """The waits inside belong to the current collective round (nested: the outer one's)."""
        if self._round_open:
            yield
            return
        self._round_open = self._round_entered = True
        try:
            yield
        finally:
            self._round_open = False

    @contextmanager
    def join(self) -> Iterator[Joined]:
        """Uneven inputs: ``with solver.join() as joined: for batch in my_loader: ...``.

        A rank whose loop ends while others still step takes part in their remaining
        rounds with an empty contribution (no gradients, no samples) and decides each
        step as they do, applying nothing; once every loop has ended, every rank takes the
        model and optimizer state of the last rank to join (``joined.last_rank``, see
        :class:`Joined`), so every rank leaves the ``with`` block with equal models and
        optimizer states whatever the loop did around ``step()`` (a scaler, clipping, a
        scheduler). Each update counts only the ranks still in their loops (see each
        solver's docs for what "average" means then). Solvers that tolerate ranks stopping
        apart (ABS-SGD, the asynchronous ones) need nothing: the context does nothing.
        """
        joined = Joined()
        if self.tolerates_uneven:
            yield joined
            return
        self._joining = True
        try:
            yield joined
        finally:
            self._joining = False
        taken = self._steps_taken()
        while self._shadow_round():
            pass
        joined.last_rank = self._sync_to_last(taken)

    def _steps_taken(self) -> int:
        """This rank's own steps so far (``join()`` compares them to find the last rank to join)."""
        return self.rounds

    def _sync_to_last(self, taken: int) -> int:
        """After ``join()``'s rounds, find the last rank to join and take its state.

        The last rank has the most ``taken`` steps, then the highest rank; every rank takes
        its model and optimizer state (:attr:`joins_to_one_model`).
        """
        size = self.comm.size
        if size == 1:
            return 0
        key = torch.tensor([taken * size + self.comm.rank], dtype=torch.int64)
        last = int(self.comm.allreduce_(key, op="max", what="join: the last rank to join").item()) % size
        if self.joins_to_one_model:
            if self._buffers is not None and self._buffers.pending:
                self._buffers.complete()  # rank 0's buffers land before the last rank's
            broadcast_module_and_optimizer(self.model, self.optimizer, self.comm, root=last)
        return last

    def _shadow_round(self) -> bool:
        """Take one collective round contributing nothing, on a rank that joined.

        Returns whether any rank still contributed (the join loop ends after the first round
        nobody did).
        """
        raise NotImplementedError(f"solver {self.name!r} does not implement join()")

    def close(self) -> None:
        """Complete or cancel outstanding communication and free MPI resources (collective).

        For the synchronous solvers the ranks first compare how many rounds they ran: if
        they differ (a rank stopped early without ``join()``), :class:`UnevenSteps` is
        raised on every rank. A second call does nothing.

        The sequence is this class's: the rounds compared (and a round some rank left in
        flight, :meth:`_round_in_flight`, completed by :meth:`_drainer`'s function), then
        the solver's own :meth:`_free`, then the hooks and the communicator released.
        """
        if self.closed:
            return
        self._end_rounds(busy=self._round_in_flight(), drain=self._drainer())
        self._free()
        self._remove_hooks()
        self.closed = True
        self.comm.free()
        if self._verdict is not None:
            raise UnevenSteps(self._verdict)

    def _round_in_flight(self) -> bool:
        """Whether this rank left a round's communication started and not complete (``close``)."""
        return False

    def _drainer(self) -> Callable[[], object] | None:
        """What completes a round some rank left in flight, on every rank (``close``).

        None: this solver starts and completes its collectives inside ``step``, so none is
        left in flight.
        """
        return None

    def _free(self) -> None:
        """End the solver's own work (collective, every rank's rounds complete).

        Its last results are settled (a center loaded, a final round applied) and its MPI
        resources released.
        """

    def _remove_hooks(self) -> None:
        """The model's and the optimizer's hooks go with the solver (the optimizer may step alone after)."""
        self._sample_hook.remove()
        self._step_hook.remove()

    # --------------------------------------------------- step API machinery
    def _round_waiting(self) -> int | None:
        """The round this rank's waits belong to now, or None outside a round."""
        return self.rounds if self._round_open else None

    def _end_rounds(self, busy: bool, drain: Callable[[], object] | None) -> None:
        """First thing in ``close()`` (collective): the ranks compare their rounds.

        Equal: if any rank left a round in flight (``busy``: started, not complete),
        every rank calls ``drain`` (starts what it has not and completes the round), so
        that nothing is freed while active; the buffers' broadcast completes. Different
        rounds, or a round in flight that this solver cannot ``drain`` (None: its
        collectives are started and completed inside ``step``, so only a wait
        interrupted by another rank's ``close`` leaves one): :class:`UnevenSteps` now, on
        every rank, and the MPI resources still in use are left allocated (freeing an
        active request is erroneous, and no rank will complete it).
        """
        notices, self._notices = self._notices, None
        if notices is None:
            if busy and drain is not None:
                drain()
        else:
            table = notices.close(self.rounds, self._round_entered or busy, busy)
            stuck = any(c.busy or (drain is None and c.interrupted) for c in table.values())
            if len({c.rounds for c in table.values()}) > 1 or (stuck and drain is None):
                self._remove_hooks()
                self.closed = True
                raise UnevenSteps(notices.verdict(table) or "mpisolve: a collective round was left in flight")
            if stuck:
                assert drain is not None
                drain()
            self._verdict = notices.verdict(table)
        if self._buffers is not None:
            self._buffers.close()
            self._buffers = None

    def _end_step(self) -> None:
        """After every step: the next one may be given a scaler afresh."""
        self._unscaled_by = None

    def _end_round(self, active_ranks: int) -> None:
        """After a collective round (and its update): start broadcasting the buffers, count it.

        ``active_ranks``: ranks that were still in their loops in it (all, but under ``join``).
        """
        self._active_ranks = active_ranks
        if self._buffers is not None:
            self._buffers.start()
        self.rounds += 1
        self._round_entered = False
        self._end_step()

    def _unscale(self, scaler: GradScaler | None) -> None:
        """Unscale the gradients the step will apply, once per step."""
        if scaler is not None:
            self._scaler = scaler
        if scaler is None or not scaler.is_enabled() or self._unscaled_by is scaler:
            return
        if self._unscaled_by is not None:
            raise ValueError(f"mpisolve {self.name}: step() was given another GradScaler than synchronize()")
        try:
            scaler.unscale_(self.optimizer)
        except RuntimeError as err:
            raise RuntimeError(
                f"mpisolve {self.name}: {err} Pass the scaler to solver.synchronize(scaler=...) or "
                "solver.step(scaler=...), which unscale and step; do not call scaler.unscale_(optimizer) "
                "or scaler.step(optimizer) yourself"
            ) from err
        self._unscaled_by = scaler

    def _checks_finite(self, scaler: GradScaler | None) -> bool:
        """Whether a step's reduction is to say if its values are finite.

        For the ``nonfinite`` policy (a step given an enabled GradScaler checks what the
        scaler unscaled instead).
        """
        return self.nonfinite.policy != "ignore" and (scaler is None or not scaler.is_enabled())

    def _may_apply(self, tensors: Sequence[torch.Tensor], what: str, scaler: GradScaler | None) -> bool:
        """Whether to apply the step on ``tensors``.

        With a GradScaler, whether they are finite (a skip is the scaler's normal one,
        uncounted); else the ``nonfinite`` policy.
        """
        if scaler is not None and scaler.is_enabled():
            return all_finite(tensors)
        return self.nonfinite.ok(tensors, what)

    def _step_optimizer(self, scaler: GradScaler | None) -> None:
        """Step the user's optimizer (through the scaler, which then knows the step was taken).

        Not in a joined rank's shadow step (``join()`` gives it the last rank's model after).
        """
        if self._shadowing:
            return
        self._stepping = True
        try:
            if scaler is not None and scaler.is_enabled():
                scaler.step(self.optimizer)
            else:
                self.optimizer.step()
        finally:
            self._stepping = False

    def _refuse_direct_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """The optimizer's step pre-hook: a step the solver did not take is the loop's ``optimizer.step()``."""
        if not self._stepping:
            raise RuntimeError(
                f"mpisolve {self.name}: optimizer.step() was called directly, while the solver's step() is what "
                "combines the ranks' work and then steps the optimizer: call solver.step() in its place (with a "
                "GradScaler, solver.step(scaler=scaler) in place of scaler.step(optimizer)). The optimizer did "
                "not step"
            )

    def _global_samples(self, reduction: Reduction, batch_size: int | None) -> int:
        """The step's global sample count.

        The forward passes' (it rode with the gradients), or the sum of ``batch_size`` over
        the ranks (one small allreduce).
        """
        if batch_size is None:
            return reduction.samples
        if self._joining:
            raise ValueError(
                f"mpisolve {self.name}: step(batch_size=...) inside join(): ranks that joined cannot know "
                "to take part in the sample count's allreduce; let the forward passes count the samples"
            )
        count = torch.tensor([float(batch_size)], dtype=torch.float64)
        return int(self.comm.allreduce_(count, what="sample count").item())

    def _bucket_step(
        self,
        grads: GradientBuckets,
        batch_size: int | None,
        scaler: GradScaler | None,
        what: str,
        before_update: Callable[[], None] | None = None,
        after_update: Callable[[bool], None] | None = None,
    ) -> StepInfo:
        """The step of a solver whose gradients ``grads`` reduces.

        Complete the reduction (unless ``synchronize`` did), decide, maybe ``before_update`` and the optimizer's
        step, rearm. The reduced gradients are the same on every rank: all decide alike.
        ``after_update(applied)`` completes the solver's own work of the round, still inside it.
        """
        if grads.backward_ran and batch_size is None and self._forward_at is None:
            raise RuntimeError(
                f"mpisolve {self.name}: gradients arrived but no training forward of the solver's model was seen, "
                "so the samples cannot be counted. A forward in eval mode (model.eval()) or inside "
                "solver.evaluating() is not a training one: train in model.train(), or pass step(batch_size=...). "
                "If the model is torch.compile'd, give the compiled module to make_solver (or make the solver "
                "before the compiled module's first call)"
            )
        scaled = scaler is not None and scaler.is_enabled()
        # The scaler unscales in place; without one the finite check rides with the tally's read.
        reduction = grads.finish(writable=scaled, check_finite=self._checks_finite(scaler))
        self._unscale(scaler)
        samples = self._global_samples(reduction, batch_size)
        local = self.take_samples(batch_size)
        if scaled:
            applied = reduction.ranks > 0 and all_finite(grads.reduced())
        else:
            applied = reduction.ranks > 0 and self.nonfinite.decide(reduction.finite, what)
        if applied:
            if before_update is not None:
                before_update()
            self._step_optimizer(scaler)
            if not self._shadowing:
                grads.stepped()
        if after_update is not None:
            after_update(applied)
        grads.rearm()
        self._end_round(reduction.ranks)
        return StepInfo(applied=applied, global_samples=samples if applied else 0, local_samples=local)

    def _shadow_bucket_round(self, grads: GradientBuckets) -> bool:
        """Join's round for a bucket solver: withhold from the buckets, then the solver's own step."""
        grads.withhold()
        return self._shadow_step()

    def _shadow_step(self) -> bool:
        """A joined rank's step, decided as the ranks in their loops decide theirs.

        It applies nothing; returns whether any rank contributed.

        With the GradScaler this rank was last given: the step unscales through it as theirs
        do, and it is updated as their loops update theirs (so its scale stays theirs: K-FAC
        unscales its factors by it); a last round nobody contributed to leaves its scale as it is.
        """
        scaler = self._scaler
        self._shadowing = True
        try:
            self.step(scaler=scaler)
        finally:
            self._shadowing = False
        if scaler is not None and scaler.is_enabled():
            scaler.update() if self._active_ranks > 0 else scaler.update(new_scale=scaler.get_scale())
        return self._active_ranks > 0

    @contextmanager
    def evaluating(self) -> Iterator[torch.nn.Module]:
        """A context in which the model holds the parameters to evaluate.

        By default the model as it is (with rank 0's buffers, when they are broadcast);
        solvers whose result lives elsewhere (the EASGD family's center variable) swap it
        in for the duration (:meth:`_evaluation`). Forwards inside are not training ones,
        whatever the model's mode and autograd's: they count no samples and no K-FAC factors.
        """
        self._evaluating += 1
        try:
            with self._evaluation() as model:
                yield model
        finally:
            self._evaluating -= 1

    @contextmanager
    def _evaluation(self) -> Iterator[torch.nn.Module]:
        """:meth:`evaluating`'s model: this one, with rank 0's buffers when they are broadcast."""
        if self._buffers is not None:
            self._buffers.complete()
        yield self.model

    def broadcast_state(self, root: int = 0) -> None:
        """Give every rank ``root``'s parameters, buffers and optimizer state (collective).

        After rank ``root`` alone loaded a checkpoint, or any change made on some ranks only. Between
        steps; the solver's own state (``state_dict``) is not sent.
        """
        broadcast_module_and_optimizer(self.model, self.optimizer, self.comm, root)

    def state_dict(self) -> dict[str, Any]:
        """The solver's own state (not the model's or optimizer's)."""
        return {
            "solver": self.name,
            "options": options_to_dict(self.options),
            "nonfinite_skipped": self.nonfinite.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave, on every rank; refused for another solver's state."""
        if state.get("solver") != self.name:
            raise ValueError(f"this state is from solver {state.get('solver')!r}, not {self.name!r}")
        self.nonfinite.skipped = int(state.get("nonfinite_skipped", 0))

    def __repr__(self) -> str:
        """``AllreduceSolver('allreduce', rank 0 of 2, bucket_mb=10.0)``.

        The options that differ from their defaults (callables by name), and whether the
        solver is closed.
        """
        defaults = {f.name: f.default for f in dataclasses.fields(self.options)}
        parts = [repr(self.name), f"rank {self.comm.rank} of {self.comm.size}"] + (["closed"] if self.closed else [])
        parts += [
            f"{k}={v if callable(getattr(self.options, k)) else repr(v)}"
            for k, v in options_to_dict(self.options).items()
            if getattr(self.options, k) != defaults[k]
        ]
        registered = _REGISTRY.get(self.name, type(self))  # a mode's private class shows as its solver
        return f"{registered.__name__}({', '.join(parts)})"

    def __enter__(self) -> Solver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BucketSolver(Solver[OptionsT]):
    """A solver whose gradients live in :class:`GradientBuckets`, reduced while backward runs.

    ``self.grads`` is made in ``setup``; zeroing, accumulation, early completion,
    uneven inputs and closing are the buckets' (``allreduce``, ``lb-bsp``, ``kfac``).
    """

    grads: GradientBuckets

    def _gradient_buckets(self, bucket_mb: float, **how: Any) -> GradientBuckets:
        """The model's buckets of ``bucket_mb`` MB, counting this rank's samples; ``how``: their other settings."""
        return GradientBuckets(
            self.params, self.comm, bucket_bytes=int(bucket_mb * 1e6), samples=self.samples_seen, **how
        )

    @property
    def node_shared(self) -> bool:
        """Whether the buckets' sums run in node-shared memory."""
        return self.grads.node is not None

    def zero_grad(self) -> None:
        """Zero the buckets (the gradients are views into them)."""
        self.grads.zero_()

    def no_sync(self) -> AbstractContextManager[None]:
        """Accumulate into the buckets without reducing them."""
        return self.grads.no_sync()

    def _synchronize(self, scaler: GradScaler | None) -> None:
        """Complete the buckets' reduction now, into this rank's own copy (to clip or unscale in place).

        Whether the reduced gradients are finite is read with them, now: the step applies
        them, or not, on that finding (clipping keeps finite values finite).
        """
        self.grads.finish(writable=True, check_finite=self._checks_finite(scaler))
        self._unscale(scaler)

    def _shadow_round(self) -> bool:
        return self._shadow_bucket_round(self.grads)

    def _round_in_flight(self) -> bool:
        return self.grads.in_flight

    def _drainer(self) -> Callable[[], object] | None:
        return self._drain

    def _drain(self) -> None:
        """Complete a round some rank left in flight (``close``)."""
        self.grads.finish()

    def _free(self) -> None:
        """Release the solver's MPI resources once every rank's rounds are complete."""
        self.grads.close()


# ----------------------------------------------------------------- registry
_REGISTRY: dict[str, type[Solver]] = {}


def register(cls: type[Solver]) -> type[Solver]:
    """Class decorator: make a solver available to ``make_solver`` and the CLI by its name."""
    if cls.name in _REGISTRY:
        raise ValueError(f"a solver named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def solver_class(name: str) -> type[Solver]:
    """The registered class of solver ``name``, or :class:`OptionError` naming the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise OptionError(f"unknown solver {name!r} (known: {', '.join(sorted(_REGISTRY))})") from None


def solver_names() -> list[str]:
    """The names of every registered solver."""
    return sorted(_REGISTRY)


def make_solver(
    name: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    comm: MPI.Comm | Communicator | None = None,
    **options: Any,
) -> Solver:
    """Build the solver called ``name`` around the user's model and optimizer."""
    return solver_class(name)(model, optimizer, comm, **options)
