"""Horovod's ``DistributedOptimizer``, on the ``allreduce`` and ``adasum`` solvers' buckets.

``hvd.DistributedOptimizer(optimizer, ...)`` returns an instance of a subclass of the
optimizer's own class sharing its parameter groups and state, as Horovod's does. What
combines the gradients:

- ``op=Average`` or ``Sum`` (the default path): :class:`~mpisolve.comm.buckets.GradientBuckets`,
  the allreduce solver's fused buckets: each ``p.grad`` is a view into a bucket, a bucket's
  sum starts from the autograd hooks as soon as its gradients are in (overlapping the rest
  of backward; node-shared where ranks share a node), and ``step`` completes them.
- ``op=Adasum`` (more than one rank): :class:`~mpisolve.solvers.adasum.DeltaBuckets`, the
  adasum solver's delta mode (Horovod's: a local step, then the model deltas combined).
- ``compression`` other than ``none``, or a ``SparseAdam``: Horovod's own way, one
  collective per gradient started from its hook (in a fixed order every rank follows),
  compressed, or a sparse gradient gathered as indices and values.

``groups``/``num_groups`` are checked and change nothing: buckets fuse gradients by size
(``HOROVOD_FUSION_THRESHOLD`` bytes, else 25 MB). ``gradient_predivide_factor`` splits
the average around the sum as Horovod's does; sums run in float32 or wider (half-precision
buckets too), so the result is the average, up to rounding.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ..comm.buckets import GradientBuckets
from ..solvers.adasum import DeltaBuckets
from .compression import Compression, Compressor
from .mpi_ops import (
    Adasum,
    Average,
    ProcessSet,
    Sum,
    allreduce_async,
    global_process_set,
    size,
    sparse_allreduce_async,
    synchronize,
)

DEFAULT_BUCKET_BYTES = 25_000_000


class _DistributedOptimizer(torch.optim.Optimizer):
    """The methods a wrapped optimizer gains (mixed in before its own class)."""

    _buckets: GradientBuckets | None
    _deltas: DeltaBuckets | None
    _hooked: _PerTensor | None

    def _setup(
        self,
        named_parameters: Any,
        compression: type[Compressor],
        backward_passes_per_step: int,
        op: int,
        gradient_predivide_factor: float,
        groups: Any,
        sparse_as_dense: bool,
        process_set: ProcessSet,
    ) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        self._parameter_names = _names(named_parameters, self.param_groups, params)
        _check_groups(groups)
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.process_set = process_set
        self._synchronized = False
        self._should_synchronize = True
        self._buckets = self._deltas = self._hooked = None
        trained = [p for p in params if p.requires_grad]
        if not process_set.included() or process_set.size() == 1 or not trained:
            return
        assert process_set.comm is not None
        comm = process_set.comm.dup(name="horovod.optimizer")
        bucket_bytes = int(os.environ.get("HOROVOD_FUSION_THRESHOLD", DEFAULT_BUCKET_BYTES)) or DEFAULT_BUCKET_BYTES
        if op == Adasum:
            self._deltas = DeltaBuckets(trained[::-1], comm, bucket_bytes=bucket_bytes)
        elif compression is not Compression.none or isinstance(self, torch.optim.SparseAdam):
            self._hooked = _PerTensor(
                trained, self._parameter_names, compression, op, gradient_predivide_factor, sparse_as_dense, self
            )
        else:
            self._buckets = GradientBuckets(
                trained, comm, bucket_bytes=bucket_bytes, average=op == Average, passes=backward_passes_per_step
            )

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Gradients accumulate over ``passes`` backward passes before they are reduced."""
        if passes < 1:
            raise ValueError("backward_passes_per_step must be > 0")
        self.backward_passes_per_step = passes
        if self._buckets is not None:
            self._buckets.passes = passes
        if self._hooked is not None:
            self._hooked.rearm()

    def synchronize(self) -> None:
        """Complete the gradients' reduction now (to clip or inspect them); then use
        ``with optimizer.skip_synchronize(): optimizer.step()``."""
        self._reduce(writable=True)
        self._synchronized = True

    def _reduce(self, writable: bool) -> None:
        if self._buckets is not None:
            self._buckets.finish(writable=writable)
        elif self._hooked is not None:
            self._hooked.finish()

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step`` inside does not reduce the gradients (``synchronize`` did)."""
        if self._deltas is not None:
            raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """Reduce the gradients (unless skipped), then the wrapped optimizer's step."""
        if self._deltas is not None:
            loss = closure() if closure is not None else None
            self._deltas.begin()
            super().step()
            self._deltas.reduce()
            return loss
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                    "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.",
                    stacklevel=2,
                )
            self._reduce(writable=False)
        self._synchronized = False
        loss = super().step(closure)
        if self._buckets is not None:
            self._buckets.rearm()
        if self._hooked is not None:
            self._hooked.rearm()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients: in place in their buckets (they stay views), else as the optimizer does."""
        if self._buckets is not None:
            self._buckets.zero_()
            return
        if self._hooked is not None and self._hooked.handles:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(). This is prohibited as it can cause a race condition."
            )
        super().zero_grad(set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._synchronized = False
        self._should_synchronize = True
        super().load_state_dict(state_dict)


class _PerTensor:
    """Horovod's per-gradient collectives, started from each gradient's hook in a fixed order
    (reverse registration, as buckets): a gradient whose turn has not come waits for those
    before it, and ``finish`` starts the rest, so every rank starts them in one order."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        names: dict[torch.nn.Parameter, str],
        compression: type[Compressor],
        op: int,
        predivide: float,
        sparse_as_dense: bool,
        optimizer: _DistributedOptimizer,
    ) -> None:
        self.order = params[::-1]
        self.names = names
        self.compression = compression
        self.op = op
        self.scales = (1.0 / predivide, predivide) if op == Average else (1.0, 1.0)
        self.sparse_as_dense = sparse_as_dense
        self.optimizer = optimizer
        self.handles: dict[torch.nn.Parameter, tuple[Any, Any]] = {}
        self.ready: set[torch.nn.Parameter] = set()
        self.arrivals: dict[torch.nn.Parameter, int] = {}
        self._next = 0
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, param: torch.Tensor) -> None:
        passes = self.optimizer.backward_passes_per_step
        arrived = self.arrivals.get(param, 0) + 1  # type: ignore[call-overload]
        if arrived > passes:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call to step(). "
                "Increase backward_passes_per_step to accumulate gradients locally."
            )
        self.arrivals[param] = arrived  # type: ignore[index]
        if arrived == passes:
            self.ready.add(param)  # type: ignore[arg-type]
            while self._next < len(self.order) and self.order[self._next] in self.ready:
                self._start(self.order[self._next])
                self._next += 1

    def _start(self, p: torch.nn.Parameter) -> None:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        name = self.names[p]
        grad = p.grad
        if grad.is_sparse and not self.sparse_as_dense:
            self.handles[p] = (sparse_allreduce_async(grad, name=name, op=self.op), None)
            return
        dense = grad.to_dense() if grad.is_sparse else grad
        compressed, ctx = self.compression.compress(dense)
        pre, post = self.scales
        self.handles[p] = (
            allreduce_async(compressed, name=name, op=self.op, prescale_factor=pre, postscale_factor=post),
            ctx,
        )

    def finish(self) -> None:
        """Start what backward did not, in order; complete all; the results in ``p.grad``."""
        while self._next < len(self.order):
            self._start(self.order[self._next])
            self._next += 1
        for p, (handle, ctx) in self.handles.items():
            output = handle() if callable(handle) else self.compression.decompress(synchronize(handle), ctx)
            assert p.grad is not None
            with torch.no_grad():
                if p.grad.is_sparse:
                    p.grad = output if output.is_sparse else output.to_sparse()
                else:
                    p.grad.copy_(output)
        self.handles.clear()

    def rearm(self) -> None:
        self.handles.clear()
        self.ready.clear()
        self.arrivals.clear()
        self._next = 0


def _names(named_parameters: Any, param_groups: list[dict[str, Any]], params: list[Any]) -> dict[Any, str]:
    """Horovod's checks of ``named_parameters``; each parameter's name."""
    if named_parameters is None:
        return {
            p: f"allreduce.noname.{i}.{j}"
            for i, group in enumerate(param_groups)
            for j, p in enumerate(group["params"])
        }
    named = list(named_parameters)
    if any(not isinstance(p, tuple) for p in named):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), usually produced by "
            "model.named_parameters()."
        )
    seen: set[str] = set()
    duplicates = sorted({name for name, _ in named if name in seen or seen.add(name)})  # type: ignore[func-returns-value]
    if duplicates:
        raise ValueError(
            f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(duplicates)}"
        )
    unnamed = {id(p) for p in params} - {id(p) for _, p in named}
    if unnamed:
        raise ValueError(
            "named_parameters was specified, but one or more model parameters were not named. "
            f"Python object ids: {', '.join(map(str, sorted(unnamed)))}"
        )
    return {p: name for name, p in named}


def _check_groups(groups: Any) -> None:
    if groups is None:
        return
    if not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    if isinstance(groups, list):
        seen: set[int] = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))


_CLASSES: dict[type, type[_DistributedOptimizer]] = {}


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Any = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """``optimizer`` with its gradients combined across the ranks of ``process_set`` (see the module).

    The result is an instance of ``optimizer``'s class sharing its parameter groups and
    state; use it in place of ``optimizer``. ``synchronize()`` completes the reduction
    early (gradient clipping); then step inside ``skip_synchronize()``.
    """
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if op not in (Average, Sum, Adasum):
        raise ValueError(f"DistributedOptimizer combines by hvd.Average, hvd.Sum or hvd.Adasum, got op={op!r}")
    if num_groups != 0:
        warnings.warn(
            "Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
            DeprecationWarning,
            stacklevel=2,
        )
        if groups is None:
            groups = num_groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op == Adasum and size() > 1 and process_set.process_set_id != 0:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    base = type(optimizer)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(base.__name__, (_DistributedOptimizer, base), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._setup(
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
        process_set,
    )
    return wrapped


__all__: Sequence[str] = ["DistributedOptimizer"]
