"""The EASGD family and EA-wild: workers that step on their own and meet through a shared vector.

Every rank trains its own copy x_i of the model with the user's optimizer and, every
``tau`` steps, exchanges with a vector all ranks share:

========================  ==========================================================  ==========
solver                    exchange every ``tau`` local steps                          shared via
========================  ==========================================================  ==========
``easgd``                 x_c += alpha sum_i (x_i - x_c);  x_i -= alpha (x_i - x_c)     allreduce
``async-sgd``             W += x_i - x_anchor;  x_i = x_anchor = W  (Downpour)          window, locked
``async-msgd``            as async-sgd, local steps with Nesterov momentum              window, locked
``hogwild-sgd``           as async-sgd, no locks at all (Hogwild)                       window, wild
``async-easgd``           d = alpha (x_i - x_c);  x_i -= d;  x_c += d                   window, locked
``async-measgd``          as async-easgd, local steps with Nesterov momentum (EAMSGD)   window, locked
``ea-wild``               as async-easgd, no locks at all (Hogwild EASGD)               window, wild
========================  ==========================================================  ==========

``easgd`` is synchronous: every rank holds the same center, and one allreduce of the
differences per exchange updates it everywhere. The asynchronous solvers keep the
center x_c (or the shared parameters W) in a :class:`~mpisolve.comm.windows.SharedVector`
and never wait for another worker: *locked* exchanges hold an exclusive lock on each
shard while reading and writing it (a parameter server serving one worker at a time),
*wild* ones take no lock (see the window module for the memory paths).

``alpha = eta * rho`` (give ``alpha`` or ``rho``; the default ``alpha = 0.9 / ranks``
is the EASGD paper's beta = p alpha = 0.9). The ``m`` variants apply Nesterov momentum
to each local step of the user's optimizer (v = mu v + delta; x += mu v), so give them an
optimizer without momentum. The model's parameters become views into one flat tensor
(one dtype, on the model's device, CPU or GPU); buffers (batch-norm statistics) stay per
rank. ``close()`` leaves the center (the result) in every rank's model, and
:meth:`evaluating` shows it meanwhile.

On a GPU, ``easgd``'s allreduce goes to MPI as every collective does (directly to a
CUDA-aware MPI, else staged). The windowed solvers keep the shared vector in host memory
(``window="host"``, the default): an exchange copies the parameters into a pinned host
twin, reused every time, runs there (on the host, as on the CPU) and copies them back.
``window="device"`` puts the shared vector in the model's device memory instead
(``MPI_Win_create``; needs an MPI whose one-sided operations take device memory), and
the exchange runs on the device with the GPU kernels, without copies to the host.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar, cast

import torch
from torch.amp import GradScaler

from ..comm.device import Stager
from ..comm.flat import TalliedBuffer, Tally, flatten_parameters
from ..comm.progress import Progress, check_progress, threads_multiple
from ..comm.readback import wait_event
from ..comm.windows import Layout, LocalVector, SharedVector
from ..errors import OptionError
from ..kernels.elastic import elastic_exchange_
from ..options import LocalStepsOptions, Options, option, require, with_default
from .base import CommonOptions, Solver, StepInfo, collective_round, register


# ------------------------------------------------------------------ options
@dataclass(frozen=True, kw_only=True)
class LocalStepOptions(LocalStepsOptions, CommonOptions):
    """Options of every solver of this module: an exchange every ``tau`` local steps."""


@dataclass(frozen=True, kw_only=True)
class MomentumOptions(Options):
    """Nesterov momentum the solver itself adds to each local step."""

    momentum: float = option(
        0.9,
        "Nesterov momentum the solver adds to each local step (EAMSGD's 0.99): give it an optimizer without momentum",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.momentum < 1, f"momentum must be in [0, 1), got {self.momentum}")


@dataclass(frozen=True, kw_only=True)
class EASGDOptions(LocalStepOptions):
    """The elastic exchange: how often, and how strongly workers and center pull together."""

    alpha: float | None = option(
        None, "elastic moving rate, in (0, 1]; None (and no rho): 0.9 / ranks; easgd needs alpha * ranks <= 1"
    )
    rho: float | None = option(None, "elastic penalty instead of alpha: alpha = lr * rho")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.alpha is None or self.rho is None, "give alpha or rho, not both")
        require(self.alpha is None or 0 < self.alpha <= 1, f"alpha must be in (0, 1], got {self.alpha}")
        require(self.rho is None or self.rho > 0, f"rho must be > 0, got {self.rho}")


WindowMemory = Literal["host", "device"]


@dataclass(frozen=True, kw_only=True)
class WindowOptions(LocalStepOptions):
    """The shared vector's MPI window: who owns it, who moves its operations along, where it lives."""

    layout: Layout = option(
        "sharded",
        "sharded: rank r owns a contiguous, cache-line aligned slice of the vector; server: rank 0 owns it all",
    )
    progress: Progress = option(
        "thread",
        "who completes passive-target RMA at a target busy computing: a thread of ours, MPICH's progress thread "
        "(launch with MPICH_ASYNC_PROGRESS=1), the library alone (none), or auto (a thread where it has a core to "
        "itself: a GPU rank, or 2 cores or more a rank; else none)",
    )
    force_internode: bool = option(False, "use the inter-node path even when all ranks share a node (to test it)")
    window: WindowMemory = option(
        "host",
        "host: MPI allocates the shared vector in host memory, a GPU model's parameters reach it through a pinned "
        "host twin; device: the vector lives in the model's device memory (MPI_Win_create; a GPU model needs an "
        "MPI whose one-sided operations take device memory)",
    )
    overlap: bool = option(
        True,
        "where the parameters meet a host window through a twin (a GPU model): run each exchange on a thread of "
        "its own while training goes on, and apply its result at a later step; false: exchange in the step",
    )


@dataclass(frozen=True, kw_only=True)
class AsyncSGDOptions(WindowOptions):
    """Downpour's push period: ``tau`` local steps between pushes to the shared parameters."""

    tau: int = with_default(LocalStepsOptions, "tau", 1)


@dataclass(frozen=True, kw_only=True)
class AsyncMSGDOptions(MomentumOptions, AsyncSGDOptions):
    """Downpour with Nesterov momentum on the local steps."""


@dataclass(frozen=True, kw_only=True)
class AsyncEASGDOptions(WindowOptions, EASGDOptions):
    """EASGD's ``tau``, ``alpha``/``rho`` and the window's ``layout``, ``progress``, ``force_internode``."""


@dataclass(frozen=True, kw_only=True)
class AsyncMEASGDOptions(MomentumOptions, AsyncEASGDOptions):
    """EAMSGD: asynchronous EASGD with Nesterov momentum on the local steps."""

    momentum: float = with_default(MomentumOptions, "momentum", 0.99)


# ------------------------------------------------------------------ pieces
class NesterovMomentum:
    """Nesterov momentum around any optimizer's step: v = mu v + delta; x += mu v."""

    def __init__(self, flat: torch.Tensor, momentum: float) -> None:
        self.flat = flat
        self.momentum = momentum
        self.velocity = torch.zeros_like(flat)
        self._delta = torch.empty_like(flat)

    def step(self, optimizer_step: Callable[[], None]) -> None:
        """Around ``optimizer_step`` (the user's optimizer stepping the flat parameters)."""
        self._delta.copy_(self.flat)
        optimizer_step()
        torch.sub(self.flat, self._delta, out=self._delta)
        torch.add(self._delta, self.velocity, alpha=self.momentum, out=self.velocity)
        self.flat.add_(self.velocity, alpha=self.momentum)


LocalT = TypeVar("LocalT", bound=LocalStepOptions)
WindowT = TypeVar("WindowT", bound=WindowOptions)


class _LocalSteps(Solver[LocalT]):
    """Local optimizer steps on a flat copy of the model, an exchange every ``tau`` of them.

    Each step applies this rank's own update and, but for ``easgd``, reports only its own
    samples, so these solvers are not lockstep: a training loop sums the ranks' counts to
    know the progress.
    """

    lockstep = False
    round_per_step = False  # the rounds, where there are any, are the exchanges (every tau steps)

    def setup(self) -> None:
        momentum = self.options.momentum if isinstance(self.options, MomentumOptions) else 0.0
        if momentum and any(group.get("momentum", 0) for group in self.optimizer.param_groups):
            raise OptionError(
                f"{self.name} applies its own momentum ({momentum}); give it an optimizer without momentum"
            )
        if isinstance(self.options, EASGDOptions):
            self.alpha = _resolve_alpha(self.options, self.optimizer, self.comm.size)
        self.flat = flatten_parameters(self.params).flat
        self.momentum = NesterovMomentum(self.flat, momentum) if momentum else None
        self.steps = 0
        self._round_samples = 0
        self._swap: torch.Tensor | None = None
        self.setup_exchange()

    @abstractmethod
    def setup_exchange(self) -> None:
        """Build what the exchange needs (called once, at the end of construction)."""

    def _steps_taken(self) -> int:
        return self.steps

    def _step(self, batch_size: int | None, scaler: GradScaler | None) -> StepInfo:
        self.poll()
        self._unscale(scaler)
        local = self.take_samples(batch_size)
        # Each rank checks its own gradients and skips alone: nothing non-finite is exchanged.
        applied = self._may_apply([p.grad for p in self.params if p.grad is not None], "local gradients", scaler)
        if applied and self.momentum is not None:
            self.momentum.step(lambda: self._step_optimizer(scaler))
        elif applied:
            self._step_optimizer(scaler)
        self.steps += 1  # a skipped step still counts towards tau: exchanges stay on schedule
        self._round_samples += local if applied else 0
        exchanged = self.steps % self.options.tau == 0
        if exchanged:
            self.exchange()
        self._end_step()
        # A lockstep solver (easgd) reports every step as applied on every rank, so that all
        # count the same steps; its skipped steps add no samples.
        counted = self.reported_samples(local if applied else 0, exchanged)
        info = StepInfo(applied=applied or self.lockstep, global_samples=counted, local_samples=local)
        if exchanged:
            self._round_samples = 0
        return info

    @abstractmethod
    def exchange(self) -> None:
        """Meet the other workers (called every ``tau`` local steps; ends the round)."""

    def poll(self) -> None:
        """At the start of each step: take in the exchange started at the last one (overlapped exchanges)."""

    def _settle(self) -> None:
        """Before the parameters are read or swapped whole: an exchange in flight completed and taken in."""

    def reported_samples(self, local: int, exchanged: bool) -> int:
        """``StepInfo.global_samples`` of a step: this rank's ``local`` samples (not lockstep)."""
        return local

    @abstractmethod
    def read_center(self, out: torch.Tensor) -> None:
        """Copy the current center (the result) into ``out``."""

    @contextmanager
    def _evaluation(self) -> Iterator[torch.nn.Module]:
        """The model holds the center for the duration; this worker's parameters come back after."""
        self._settle()
        if self._swap is None:
            self._swap = torch.empty_like(self.flat)
        self._swap.copy_(self.flat)
        self.read_center(self.flat)
        try:
            yield self.model
        finally:
            self.flat.copy_(self._swap)

    def state_dict(self) -> dict[str, Any]:
        center = torch.empty_like(self.flat)
        self.read_center(center)
        velocity = self.momentum.velocity.clone() if self.momentum is not None else None
        return {
            **super().state_dict(),
            "center": center,
            "steps": self.steps,
            "round_samples": self._round_samples,
            "velocity": velocity,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Collective: every rank loads the same state's center."""
        super().load_state_dict(state)
        self.steps = int(state["steps"])
        self._round_samples = int(state["round_samples"])
        if self.momentum is not None:
            self.momentum.velocity.copy_(state["velocity"])


def _resolve_alpha(options: EASGDOptions, optimizer: torch.optim.Optimizer, ranks: int) -> float:
    if options.alpha is not None:
        return options.alpha
    if options.rho is not None:
        alpha = optimizer.param_groups[0]["lr"] * options.rho
        require(0 < alpha <= 1, f"alpha = lr * rho must be in (0, 1], got {alpha}")
        return alpha
    return 0.9 / ranks


# ------------------------------------------------------------------ synchronous EASGD
@register
class EASGDSolver(_LocalSteps[EASGDOptions]):
    """Synchronous EASGD: every ``tau`` steps each worker and the (replicated) center pull together.

    x_c += alpha sum_i (x_i - x_c) and x_i -= alpha (x_i - x_c), both from the old
    values, with one allreduce of the differences. beta = ranks * alpha must be <= 1.
    Under ``join()`` a rank whose data has run out pulls on the center at the next
    exchange if it stepped since the last one, and not after.
    """

    name = "easgd"
    Options = EASGDOptions
    round_unit = "exchanges"
    joins_to_one_model = False  # the workers differ by design; the result is the center
    #: Every rank steps and exchanges in lockstep, and an exchange reports the samples all
    #: ranks covered since the previous one (they ride in its allreduce). Counted as the
    #: asynchronous solvers are, a rank could stop or evaluate while another waits in an
    #: exchange: a deadlock.
    lockstep = True

    def setup_exchange(self) -> None:
        require(
            self.alpha * self.comm.size <= 1,
            f"easgd needs alpha * ranks <= 1 (the center's step beta), got {self.alpha} * {self.comm.size}",
        )
        self.center = self.flat.clone()
        # The differences, then (on the CPU) the round's samples and the ranks still in their loops.
        self._wire = TalliedBuffer.laid_out(
            self.comm, [self.flat.shape], self.flat.dtype, self.flat.device, Tally(samples=1, active=1)
        )
        self._diff = self._wire.body

    def exchange(self) -> None:
        self._exchange(active=True)

    @collective_round
    def _exchange(self, active: bool) -> None:
        if active or self._round_samples > 0:
            torch.sub(self.flat, self.center, out=self._diff)
            self.flat.sub_(self._diff, alpha=self.alpha)
        else:  # a rank that joined and has not stepped since the last exchange pulls nothing
            self._diff.zero_()
        counts = self._wire.counts
        counts.set("samples", self._round_samples)
        counts.set("active", int(active))
        self._wire.start()
        self._wire.wait("easgd exchange")
        self.center.add_(self._diff, alpha=self.alpha)
        self._end_round(counts.count("active"))

    def _shadow_round(self) -> bool:
        """A joined rank's part in the next exchange."""
        self.steps += self.options.tau - self.steps % self.options.tau
        self._exchange(active=False)
        self._round_samples = 0
        return self._active_ranks > 0

    def reported_samples(self, local: int, exchanged: bool) -> int:
        """All ranks' samples since the previous exchange at an exchange, else 0 (lockstep)."""
        return self._wire.counts.count("samples") if exchanged else 0

    def read_center(self, out: torch.Tensor) -> None:
        out.copy_(self.center)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.center.copy_(state["center"])

    def _free(self) -> None:
        """Every rank's model becomes rank 0's center (bit for bit)."""
        self.comm.bcast_(self.center, what="easgd center")
        self.flat.copy_(self.center)
        self._wire.free()


# ------------------------------------------------------------------ windowed, asynchronous
class _Windowed(_LocalSteps[WindowT]):
    """The asynchronous solvers: the shared vector lives in a :class:`SharedVector`.

    Ranks may stop at different steps: ``close`` waits until every rank has stopped
    writing, so ``join()`` has nothing to do.

    The exchange's function sees this worker's parameters as :attr:`local`, in the
    memory the vector lives in: the flat parameters themselves (a CPU model, or
    ``window="device"``), else their pinned host twin, which :attr:`stage` fills before
    the exchange and copies back after (reused every time). With a twin and ``overlap``,
    the exchange runs on a thread of its own (:class:`OverlappedExchange`): the step
    only snapshots the parameters, and a later step adds what the exchange changed.

    Over one rank there is nobody to meet: the vector is a tensor on the model's device
    (:class:`~mpisolve.comm.windows.LocalVector`), no window, lock or host copy.
    """

    locked: ClassVar[bool]
    tolerates_uneven = True

    def setup_exchange(self) -> None:
        check_progress(self.options.progress)  # checked at one rank too, where no window needs it
        self.alone = self.comm.size == 1 and not self.comm.stage_all
        self._overlapped: OverlappedExchange | None = None
        if self.alone:
            self.vector: SharedVector | LocalVector = LocalVector(self.flat.numel(), self.flat.dtype, self.flat.device)
            self.stage = Stager(self.flat)
            self.local = self.flat
            self.vector.store_(self.flat)
            return
        on_device = self.options.window == "device"
        if on_device and self.flat.device.type == "cuda":
            self.comm.agree(lambda: _require_cuda_aware(self.comm.cuda_aware, self.comm.cuda_aware_source))
        self.vector = SharedVector(
            self.comm,
            self.flat.numel(),
            self.flat.dtype,
            layout=self.options.layout,
            locked=self.locked,
            force_internode=self.options.force_internode,
            progress=self.options.progress,
            device=self.flat.device if on_device else None,
        )
        self.stage = Stager(self.flat) if on_device else self.comm.stager(self.flat, host=True)
        #: This worker's parameters where the exchange sees them (the vector's memory).
        self.local = self.stage.memory
        self.vector.store_(self.flat)
        if self.options.overlap and self.local is not self.flat and threads_multiple():
            self._overlapped = OverlappedExchange(self.flat, self.local, self._exchange_local, self.name)

    def exchange(self) -> None:
        if self._overlapped is not None:
            self._overlapped.start()
            return
        if self.alone:
            self.vector.update(self.exchange_function)
            return
        self.stage.to_mpi()
        self.comm.wait_for(self.stage.ready, f"{self.name}: parameters to reach the exchange")
        self._exchange_local()
        self.stage.from_mpi()

    def _exchange_local(self) -> None:
        """The exchange on :attr:`local`, once it holds the parameters."""
        self.vector.update(self.exchange_function)

    def poll(self) -> None:
        if self._overlapped is not None:
            self._overlapped.apply()

    def _settle(self) -> None:
        if self._overlapped is not None:
            self._overlapped.apply()

    @abstractmethod
    def exchange_function(self, center: torch.Tensor, start: int, stop: int) -> None:
        """Exchange elements ``start:stop`` of :attr:`local` with ``center`` (in place, both)."""

    def read_center(self, out: torch.Tensor) -> None:
        self._settle()
        if self.local is self.flat or out.device == self.local.device:
            self.vector.read(out)
        else:
            self.vector.read(self.local)  # refilled from the parameters by the next exchange
            out.copy_(self.local)

    def state_dict(self) -> dict[str, Any]:
        self._settle()
        return super().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._settle()
        super().load_state_dict(state)
        self.vector.store_(state["center"])

    def _free(self) -> None:
        """Collective: wait until every rank has stopped writing, load the center, free the window."""
        if self._overlapped is not None:
            self._overlapped.apply()
            self._overlapped.close()
        self.vector.quiesce()
        self.read_center(self.flat)
        self.vector.close()


class OverlappedExchange:
    """A windowed solver's exchanges, each on a thread of its own while training goes on.

    :meth:`start` snapshots the flat parameters into a device copy (one copy on the
    current stream, which then runs on) and hands the rest to a worker thread: the copy to
    the host twin on a side stream, the exchange on the twin, and what it changed (the twin
    after minus before). The next step's :meth:`apply` adds that change to the parameters,
    which have moved on by one local step meanwhile: the exchange overlaps that step's
    forward and backward, and acts as if it had happened one step earlier, as asynchronous
    exchanges may (always one step: runs are reproducible). If the exchange is still
    running then, :meth:`apply` waits for it. Nothing here waits for the device on the
    training thread; the worker waits for its copy. An error in the worker is raised by
    the next :meth:`apply`.
    """

    def __init__(self, flat: torch.Tensor, local: torch.Tensor, exchange: Callable[[], None], name: str) -> None:
        self.flat = flat
        self.local = local
        self._exchange = exchange
        self._cuda = flat.device.type == "cuda"
        self._snapshot = torch.empty_like(flat)  # on the device: the copy to the host reads this, not flat
        self._before = torch.empty_like(local)  # on the host: the twin before the exchange, then the change
        self._change = torch.empty_like(flat)
        self._side = torch.cuda.Stream(flat.device) if self._cuda else None
        self._copied = torch.cuda.Event() if self._cuda else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mpisolve-{name}-exchange")
        self._future: Future[None] | None = None

    def start(self) -> None:
        """Start an exchange of the parameters as they are now (after applying the last one)."""
        self.apply()
        self._snapshot.copy_(self.flat)
        if self._side is not None and self._copied is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.flat.device))
            with torch.cuda.stream(self._side):
                self.local.copy_(self._snapshot, non_blocking=True)
                self._copied.record()
        else:
            self.local.copy_(self._snapshot)
        self._future = self._pool.submit(self._run)

    def _run(self) -> None:
        if self._copied is not None:
            wait_event(self._copied, self.flat.device)
        self._before.copy_(self.local)
        self._exchange()
        torch.sub(self.local, self._before, out=self._before)

    def apply(self) -> None:
        """Add the change of the exchange in flight, if any, to the parameters (waiting for it to finish)."""
        future = self._future
        if future is None:
            return
        self._future = None
        future.result()
        if self._side is not None:
            # The change reaches the device on the side stream; the current stream waits for it there.
            with torch.cuda.stream(self._side):
                self._change.copy_(self._before, non_blocking=True)
            torch.cuda.current_stream(self.flat.device).wait_stream(self._side)
            self.flat.add_(self._change)
        else:
            self.flat.add_(self._before)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _require_cuda_aware(aware: bool, source: str) -> None:
    require(
        aware,
        f"window='device' puts the shared vector in GPU memory, which needs a CUDA-aware MPI; this one is not "
        f"({source}): use window='host'",
    )


class _SharedParameters(_Windowed[WindowT]):
    """Downpour-style: push the local progress since the last exchange, pull the shared parameters."""

    def setup_exchange(self) -> None:
        super().setup_exchange()
        #: The parameters as last pulled, in the vector's memory.
        self.anchor = torch.empty_like(self.local)
        self.anchor.copy_(self.flat)

    def exchange(self) -> None:
        if not self.alone:  # alone, the shared parameters are this worker's: pushing and pulling change nothing
            super().exchange()

    def read_center(self, out: torch.Tensor) -> None:
        if self.alone:
            out.copy_(self.flat)
        else:
            super().read_center(out)

    def exchange_function(self, shared: torch.Tensor, start: int, stop: int) -> None:
        x, anchor = self.local[start:stop], self.anchor[start:stop]
        torch.sub(x, anchor, out=anchor)  # this worker's progress since its last pull
        shared.add_(anchor)
        x.copy_(shared)
        # From the same read: on a wild window another rank may write between two reads of
        # shared, and an anchor off the pulled x would make the next push cancel that write.
        anchor.copy_(x)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "anchor": self.anchor.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.anchor.copy_(state["anchor"])


class _ElasticExchange(_Windowed[WindowT]):
    """Asynchronous EASGD: d = alpha (x_i - x_c); x_i -= d; x_c += d, against the shared center."""

    def exchange_function(self, center: torch.Tensor, start: int, stop: int) -> None:
        elastic_exchange_(self.local[start:stop], center, self.alpha)


def _window_solver(
    class_name: str, name: str, exchange: type[_Windowed[Any]], options: type[WindowOptions], *, locked: bool
) -> type[_Windowed[Any]]:
    """Register the window solver ``name``: ``exchange`` with ``options``, its exchanges locked per shard or wild.

    The window solvers differ only in these, so each is a class made here, with its own
    registered name, options and checkpoints.
    """
    steps = " Nesterov momentum on the local steps." if issubclass(options, MomentumOptions) else ""
    locking = "Each exchange holds its shard's lock." if locked else "No lock at all (Hogwild)."
    doc = f"``{name}``: {exchange.__doc__} {locking}{steps}"
    attributes = {"__module__": __name__, "__doc__": doc, "name": name, "Options": options, "locked": locked}
    cls = type(class_name, (exchange,), attributes)
    return cast("type[_Windowed[Any]]", register(cls))


AsyncSGDSolver = _window_solver("AsyncSGDSolver", "async-sgd", _SharedParameters, AsyncSGDOptions, locked=True)
AsyncMSGDSolver = _window_solver("AsyncMSGDSolver", "async-msgd", _SharedParameters, AsyncMSGDOptions, locked=True)
HogwildSGDSolver = _window_solver("HogwildSGDSolver", "hogwild-sgd", _SharedParameters, AsyncSGDOptions, locked=False)
AsyncEASGDSolver = _window_solver("AsyncEASGDSolver", "async-easgd", _ElasticExchange, AsyncEASGDOptions, locked=True)
AsyncMEASGDSolver = _window_solver(
    "AsyncMEASGDSolver", "async-measgd", _ElasticExchange, AsyncMEASGDOptions, locked=True
)
EAWildSolver = _window_solver("EAWildSolver", "ea-wild", _ElasticExchange, AsyncEASGDOptions, locked=False)
