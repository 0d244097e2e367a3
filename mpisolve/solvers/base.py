"""The one solver interface, its options, and the registry every entry point reads.

A solver holds the user's model and optimizer (composition, never a subclass) and is
driven from the user's own loop::

    solver = mpisolve.make_solver("allreduce", model, optimizer, bucket_mb=25)
    for x, y in loader:
        solver.zero_grad()
        loss_fn(model(x), y).backward()
        info = solver.step()        # StepInfo: was an update applied, on how many samples
    solver.close()

Options are keyword-only, declared as a frozen dataclass per solver and validated when
the solver is built; the CLI's ``--set key=value`` is parsed from the same declaration.
Every solver also takes :class:`CommonOptions` (``nonfinite``).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from mpi4py import MPI

from ..comm.communicator import Communicator, as_communicator
from ..comm.state import broadcast_module_and_optimizer, check_same_model
from ..options import OptionError, build_options, option, options_to_dict
from .nonfinite import NonFiniteGuard, NonFinitePolicy


@dataclass(frozen=True)
class StepInfo:
    """What one call of ``Solver.step`` did.

    ``applied``: an update reached the model. ``global_samples``: samples the applied
    update covers over all ranks (0 when none was applied). ``local_samples``: this
    rank's samples consumed by this step. ``next_batch_size``: the micro-batch size this
    rank should draw from now on, when the solver has just changed it (a solver that
    re-splits the batch by speed as it goes); None: keep the one you have.
    """

    applied: bool
    global_samples: int
    local_samples: int
    next_batch_size: int | None = None


@dataclass(frozen=True, kw_only=True)
class CommonOptions:
    """Options every solver takes, besides its own (see :mod:`mpisolve.solvers.nonfinite`)."""

    nonfinite: NonFinitePolicy = option(
        "raise",
        "a step whose gradients or update hold a NaN or Inf: raise an error, skip it on every rank alike "
        "(counted; an error after 100 in a row), or do not check (ignore)",
    )


def with_common_options(own: type) -> type:
    """``own`` (a solver's options dataclass) extended by :class:`CommonOptions`' fields."""
    if issubclass(own, CommonOptions):
        return own
    namespace = {"__doc__": own.__doc__, "__module__": own.__module__, "__qualname__": own.__qualname__}
    return dataclass(frozen=True, kw_only=True)(type(own.__name__, (CommonOptions, own), namespace))


class Solver(ABC):
    """The interface every mpisolve solver implements."""

    name: ClassVar[str]
    #: The solver's options dataclass; a subclass's own is extended by :class:`CommonOptions`.
    Options: ClassVar[type] = CommonOptions
    #: True when every rank's ``step`` returns the same sequence of applied updates with
    #: the same ``global_samples`` (counted over all ranks): synchronous rounds, or
    #: ABS-SGD's delayed rounds, however many micro-batches each rank computes per round.
    #: A training loop can then decide when to stop or evaluate from its own counts, with
    #: no extra communication. False for asynchronous solvers, whose ``global_samples``
    #: count only this rank's contribution: the loop agrees on progress by summing them.
    lockstep: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "Options" in cls.__dict__:
            cls.Options = with_common_options(cls.Options)

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
        self.options = build_options(self.name, self.Options, options)
        self.comm = as_communicator(comm)
        self.model = model
        self.optimizer = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        check_same_model(model, self.comm)
        broadcast_module_and_optimizer(model, optimizer, self.comm)
        #: Checks updates for NaN/Inf before they reach the model (``nonfinite`` option).
        self.nonfinite = NonFiniteGuard(self.options.nonfinite, self.comm, self.name)
        self._samples = 0
        #: When the first training forward since the last step began (perf_counter), or None.
        self._forward_at: float | None = None
        self._sample_hook = model.register_forward_pre_hook(self._count_samples)
        self.closed = False
        self.setup()

    def setup(self) -> None:
        """Build the solver's own state; called once, at the end of construction.

        By then ``options``, ``comm``, ``model``, ``optimizer`` and ``params`` are set and
        the ranks' models are checked equal and synchronised. Solvers override this rather
        than ``__init__``, so every solver is built by the same signature.
        """

    # ------------------------------------------------------------- samples
    def _count_samples(self, module: torch.nn.Module, args: tuple) -> None:
        # Only training passes count: evaluation under no_grad/inference_mode does not.
        if not torch.is_grad_enabled():
            return
        if self._forward_at is None:
            self._forward_at = time.perf_counter()
        if args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0:
            self._samples += args[0].shape[0]

    def samples_seen(self) -> int:
        """Samples the training forward passes (with grad enabled) have seen since the last step."""
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
        """This rank's micro-batch size; a training loop asks once, on every rank, before drawing data
        (and follows ``StepInfo.next_batch_size`` when a step changes it).

        ``configured``: the batch size the run was given. ``probe(n)``: the seconds one
        training micro-batch of ``n`` samples takes on this rank (forward, backward and any
        emulated slowdown), for solvers that size batches by speed. By default: ``configured``.
        """
        return configured

    def zero_grad(self) -> None:
        """Clear this rank's gradients before the next backward."""
        self.optimizer.zero_grad(set_to_none=False)

    @abstractmethod
    def step(self, batch_size: int | None = None) -> StepInfo:
        """Combine work across ranks and maybe update the model.

        ``batch_size``: this rank's samples since the last step, when the model's first
        input is not batch-first; by default it is read from the forward passes.
        """

    def close(self) -> None:
        """Complete or cancel outstanding communication and free MPI resources."""
        if not self.closed:
            self._sample_hook.remove()
            self.closed = True

    @contextmanager
    def evaluating(self) -> Iterator[torch.nn.Module]:
        """A context in which the model holds the parameters to evaluate.

        By default the model as it is; solvers whose result lives elsewhere (the EASGD
        family's center variable) swap it in for the duration.
        """
        yield self.model

    def state_dict(self) -> dict[str, Any]:
        """The solver's own state (not the model's or optimizer's)."""
        return {
            "solver": self.name,
            "options": options_to_dict(self.options),
            "nonfinite_skipped": self.nonfinite.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("solver") != self.name:
            raise ValueError(f"this state is from solver {state.get('solver')!r}, not {self.name!r}")
        self.nonfinite.skipped = int(state.get("nonfinite_skipped", 0))

    def __enter__(self) -> Solver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------- registry
_REGISTRY: dict[str, type[Solver]] = {}


def register(cls: type[Solver]) -> type[Solver]:
    """Class decorator: make a solver available to ``make_solver`` and the CLI by its name."""
    if cls.name in _REGISTRY:
        raise ValueError(f"a solver named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def solver_class(name: str) -> type[Solver]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise OptionError(f"unknown solver {name!r} (known: {', '.join(sorted(_REGISTRY))})") from None


def solvers() -> list[str]:
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
