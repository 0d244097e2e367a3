"""Horovod's collectives, process sets and basics, translated onto :mod:`mpisolve.comm.ops`.

Every call goes through the checked collectives of a communicator (the world, or a
process set's): a header round that every rank sees, then the data round, so a tensor
whose shape, dtype or name differs across ranks raises :class:`HorovodInternalError` on
every rank instead of hanging. An allreduce of one tensor skips the header round: the
ranks agree its signature (dtype, shape, op, prescale and postscale factors; not its name)
once, and each call with that signature is one message (a node-shared round, or one MPI
call), run when this rank waits for a result (:mod:`mpisolve.comm.onetensor`); one whose
signature differs raises on every rank.

Unlike Horovod, collectives are matched by the order in which each rank calls them, not
by name (as MPI matches them): every rank must start the collectives of one process set
in one order. Names still label the timeline, and a name already in flight on this rank
is refused.
"""

from __future__ import annotations

import atexit
import inspect
import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar, cast

import torch

from ..comm import Communicator, as_communicator
from ..comm.ops import Call, TensorOps, tensor_ops, threads_supported
from ..comm.ops import process_set as communicator_of
from ..errors import TensorMismatchError
from .compression import Compression, Compressor
from .timeline import Timeline

# The reductions, numbered as Horovod numbers them.
Average, Sum, Adasum, Min, Max, Product = range(6)
_REDUCTIONS = {Average: "average", Sum: "sum", Adasum: "adasum", Min: "min", Max: "max", Product: "product"}


class HorovodInternalError(RuntimeError):
    """A collective failed on every rank (ranks disagreed on its tensors, or a rank has joined)."""


class _State:
    world: Communicator | None = None
    cross: Communicator | None = None
    homogeneous = True
    timeline: Timeline | None = None


_state = _State()


# ------------------------------------------------------------------ process sets
class ProcessSet:
    """Some ranks that run collectives among themselves: an MPI communicator of their own.

    Made by :func:`add_process_set` (or given to :func:`init`), collectively on every rank.
    """

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks = sorted(int(r) for r in ranks)
        self.process_set_id: int | None = None
        self.comm: Communicator | None = None
        self._engine: TensorOps | None = None  # the checked collectives of comm, kept

    def _ops(self) -> TensorOps:
        ops = self._engine
        if ops is None or ops.comm is not self.comm or self.process_set_id is None:
            if self.process_set_id is None:
                raise ValueError("this process set was not added: call hvd.add_process_set first")
            if self.comm is None:
                raise ValueError(f"rank {rank()} is not in process set {self.process_set_id} (ranks {self.ranks})")
            ops = self._engine = tensor_ops(self.comm)
        if _state.timeline is not None:
            _state.timeline.watch(ops)
        return ops

    def included(self) -> bool:
        """Whether this rank belongs to the set."""
        return self.comm is not None

    def rank(self) -> int:
        """This rank's rank within the set."""
        if self.comm is None:
            raise ValueError(f"rank {rank()} is not in process set {self.process_set_id}")
        return self.comm.rank

    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
_process_sets: dict[int, ProcessSet] = {}
_set_ids = itertools.count(1)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set (collective: every rank calls it with the same ranks).

    After :func:`init` this needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1``, as in Horovod.
    """
    world = _world()
    if os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0") in ("", "0"):
        raise ValueError("adding a process set after init needs HOROVOD_DYNAMIC_PROCESS_SETS=1")
    return _register(process_set, world)


def _register(process_set: ProcessSet | Sequence[int], world: Communicator) -> ProcessSet:
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"process set {ps.process_set_id} is already registered")
    if any(other.ranks == ps.ranks for other in _process_sets.values()) or ps.ranks == global_process_set.ranks:
        raise ValueError(f"a process set with ranks {ps.ranks} is already registered")
    ps.comm = communicator_of(ps.ranks, world)
    ps.process_set_id = next(_set_ids)
    _process_sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set and free its communicator (collective); False if it was not registered."""
    if process_set.process_set_id is None or process_set.process_set_id not in _process_sets:
        return False
    del _process_sets[process_set.process_set_id]
    if process_set.comm is not None:
        process_set.comm.free()
    process_set.comm = None
    process_set.process_set_id = None
    return True


# ------------------------------------------------------------------------ basics
def init(comm: Any = None, process_sets: Sequence[ProcessSet] | None = None) -> None:
    """Start on MPI's world (or the mpi4py communicator ``comm``). Calling it again does nothing.

    ``HOROVOD_TIMELINE=file.json`` starts the timeline (``DYNAMIC``: wait for
    :func:`start_timeline`).
    """
    if _state.world is not None:
        return
    world = as_communicator(comm)
    _state.world = world
    _state.cross = world.split(world.local_rank, name="horovod.cross")
    _state.homogeneous = len(set(world.allgather_object(world.local_size))) == 1
    global_process_set.ranks = list(range(world.size))
    global_process_set.comm = world
    tensor_ops(world)  # made now, on every rank alike
    for ps in process_sets or ():
        _register(ps, world)
    path = os.environ.get("HOROVOD_TIMELINE", "")
    if path and path != "DYNAMIC":
        start_timeline(path)


def shutdown() -> None:
    """Complete what is in flight and stop; MPI itself stays up (it cannot start again)."""
    if _state.world is None:
        return
    stop_timeline()
    tensor_ops(_state.world).barrier()
    _state.world = None


def is_initialized() -> bool:
    return _state.world is not None


def _world() -> Communicator:
    if _state.world is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _state.world


def size() -> int:
    return _world().size


def rank() -> int:
    return _world().rank


def local_size() -> int:
    return _world().local_size


def local_rank() -> int:
    return _world().local_rank


def cross_size() -> int:
    """Ranks with this rank's local rank, one per node."""
    _world()
    assert _state.cross is not None
    return _state.cross.size


def cross_rank() -> int:
    """This rank's node, counted among the ranks of its local rank."""
    _world()
    assert _state.cross is not None
    return _state.cross.rank


def is_homogeneous() -> bool:
    """Whether every node runs as many ranks."""
    _world()
    return _state.homogeneous


def mpi_threads_supported() -> bool:
    _world()
    return threads_supported()


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def nccl_built() -> int:
    """0: mpisolve moves GPU tensors through MPI (CUDA-aware or staged), not NCCL."""
    return 0


def _not_built() -> bool:
    """False: mpisolve has none of Horovod's other controllers (Gloo) or device builds (DDL, CCL, CUDA, ROCm)."""
    return False


gloo_enabled = gloo_built = ddl_built = ccl_built = cuda_built = rocm_built = _not_built


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record each collective from now on into ``file_path`` (Chrome trace; rank 0 writes it)."""
    stop_timeline()
    _state.timeline = Timeline(file_path, rank())
    for ps in [global_process_set, *_process_sets.values()]:
        if ps.included():
            ps._ops()


def stop_timeline() -> None:
    """Stop recording and write the timeline."""
    if _state.timeline is not None:
        _state.timeline.stop()
        _state.timeline = None


atexit.register(stop_timeline)


# ------------------------------------------------------------------------ handles
_handles: dict[int, tuple[Call, Callable[[Any], Any]]] = {}
_handle_ids = itertools.count(1)


def _start(
    kind: str,
    tensors: Sequence[torch.Tensor],
    process_set: ProcessSet,
    then: Callable[[Any], Any],
    **arguments: Any,
) -> int:
    handle = next(_handle_ids)
    _handles[handle] = (_begin(kind, tensors, process_set, arguments), then)
    return handle


def _begin(kind: str, tensors: Sequence[torch.Tensor], process_set: ProcessSet, arguments: dict[str, Any]) -> Call:
    """Start ``kind`` on the set's checked collectives (errors in this rank's arguments: ValueError)."""
    try:
        return process_set._ops().start(kind, tensors, **arguments)
    except TypeError as err:
        raise ValueError(str(err)) from err


def _result(call: Call) -> Any:
    """Wait for ``call``; the ranks' disagreement as Horovod's error."""
    try:
        return call.wait()
    except TensorMismatchError as err:
        raise HorovodInternalError(str(err)) from err


def poll(handle: int) -> bool:
    """Whether the collective of ``handle`` has completed (then :func:`synchronize` does not block)."""
    return _handles[handle][0].test()


def synchronize(handle: int) -> Any:
    """Wait for the collective of ``handle`` and return its result."""
    if handle not in _handles:
        return None
    call, then = _handles.pop(handle)
    return then(_result(call))


def _reduction(op: int | None, average: bool | None) -> int:
    """Horovod's op from ``op`` and the deprecated ``average``."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is not None:
        if op not in _REDUCTIONS:
            raise ValueError(f"op must be one of hvd.Average, Sum, Adasum, Min, Max, Product; got {op!r}")
        return op
    return Sum if average is False else Average


def _check_adasum(op: int, process_set: ProcessSet) -> None:
    if op == Adasum and process_set.process_set_id != 0:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")


def _first(result: list[torch.Tensor]) -> torch.Tensor:
    return result[0]


def _same(result: Any) -> Any:
    return result


# -------------------------------------------------------------------------- forms
# Horovod offers a collective in up to six forms: of a group of tensors or of one tensor,
# starting (a handle for `synchronize`) or blocking, into new tensors or into the inputs.
# Each collective's parameters are declared once, on its grouped start and on its
# differentiable grouped form; the other forms are made from those here, with Horovod's
# signatures for type checkers (the protocol, ParamSpec) and for `inspect.signature`.
_P = ParamSpec("_P")
_R = TypeVar("_R", covariant=True)
_T = TypeVar("_T")


class _OfOneTensor(Protocol[_P, _R]):
    """A collective of one tensor: ``tensor``, then its grouped form's other parameters."""

    def __call__(self, tensor: torch.Tensor, *args: _P.args, **kwargs: _P.kwargs) -> _R: ...


def _as_horovods(form: Any, like: Callable[..., Any], name: str, doc: str, *, skip: int = 0, one: bool = False) -> Any:
    """``form`` named ``name``, documented, with ``like``'s parameters after the first ``skip``.

    ``one``: the first of them is ``tensor: torch.Tensor`` (a grouped form's ``tensors``).
    """
    signature = inspect.signature(like)
    parameters = list(signature.parameters.values())[skip:]
    if one:
        parameters[0] = parameters[0].replace(name="tensor", annotation="torch.Tensor")
    form.__signature__ = signature.replace(parameters=parameters)
    form.__name__ = form.__qualname__ = name
    form.__doc__ = doc
    return form


def _one_start(grouped: Callable[Concatenate[Sequence[torch.Tensor], _P], int], doc: str) -> _OfOneTensor[_P, int]:
    """The start of one tensor: ``grouped`` of ``[tensor]``, whose handle gives the one result."""

    def start(tensor: torch.Tensor, *args: _P.args, **kwargs: _P.kwargs) -> int:
        handle = grouped([tensor], *args, **kwargs)
        call, then = _handles[handle]
        _handles[handle] = (call, lambda result: then(result)[0])
        return handle

    name = grouped.__name__.removeprefix("grouped_")
    return cast(_OfOneTensor[_P, int], _as_horovods(start, grouped, name, doc, one=True))


def _one_result(
    grouped: Callable[Concatenate[Sequence[torch.Tensor], _P], list[torch.Tensor]], doc: str
) -> _OfOneTensor[_P, torch.Tensor]:
    """The collective of one tensor: ``grouped`` of ``[tensor]``, its one result."""

    def collective(tensor: torch.Tensor, *args: _P.args, **kwargs: _P.kwargs) -> torch.Tensor:
        return grouped([tensor], *args, **kwargs)[0]

    name = grouped.__name__.removeprefix("grouped_")
    return cast(_OfOneTensor[_P, torch.Tensor], _as_horovods(collective, grouped, name, doc, one=True))


def _into(start: Callable[Concatenate[bool, _P], int], into_inputs: bool, doc: str) -> Callable[_P, int]:
    """``start``, whose first parameter says whether its results go into its inputs, with that fixed."""

    def form(*args: _P.args, **kwargs: _P.kwargs) -> int:
        return start(into_inputs, *args, **kwargs)

    name = start.__name__.removeprefix("_") + ("_" if into_inputs else "")
    return cast(Callable[_P, int], _as_horovods(form, start, name, doc, skip=1))


def _blocking(start: Callable[_P, int], result: type[_T], doc: str) -> Callable[_P, _T]:
    """``start`` waited for: its result at once (of type ``result``, for type checkers)."""

    def form(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        return cast(_T, synchronize(start(*args, **kwargs)))

    return cast(Callable[_P, _T], _as_horovods(form, start, start.__name__.replace("_async", ""), doc))


# ---------------------------------------------------------------------- allreduce
def _grouped_allreduce_async(
    into_inputs: bool,
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    reduction = _reduction(op, average)
    _check_adasum(reduction, process_set)
    out = list(tensors) if into_inputs else None
    scales = {"prescale": prescale_factor, "postscale": postscale_factor}
    return _start("allreduce", tensors, process_set, _same, op=_REDUCTIONS[reduction], name=name, out=out, **scales)


grouped_allreduce_async = _into(
    _grouped_allreduce_async, False, "Start reducing ``tensors`` as one call (fused by dtype)."
)
grouped_allreduce_async_ = _into(
    _grouped_allreduce_async, True, ":func:`grouped_allreduce_async` with the results written into ``tensors``."
)
grouped_allreduce_ = _blocking(
    grouped_allreduce_async_, list, ":func:`grouped_allreduce` in place (not differentiable)."
)
allreduce_async = _one_start(
    grouped_allreduce_async, "Start reducing ``tensor`` (untouched) across the set; a handle for :func:`synchronize`."
)
allreduce_async_ = _one_start(
    grouped_allreduce_async_, ":func:`allreduce_async` with the result written into ``tensor``."
)
allreduce_ = _one_result(grouped_allreduce_, ":func:`allreduce` in place (not differentiable).")


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Grouped allreduce; its gradients are the same grouped allreduce of the gradients."""

    @staticmethod
    def forward(ctx: Any, op: int, name: str | None, pre: float, post: float, ps: Any, *tensors: torch.Tensor) -> Any:
        ctx.args = (op, pre, post, ps)
        return tuple(synchronize(grouped_allreduce_async(tensors, None, name, op, pre, post, ps)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        op, pre, post, ps = ctx.args
        reduced = synchronize(grouped_allreduce_async(grads, None, None, op, pre, post, ps))
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """The reductions of ``tensors`` across the set as one call (``op``: Average by default), differentiable."""
    reduction = _reduction(op, average)
    if compression is not Compression.none:
        packed = [compression.compress(t) for t in tensors]
        pre, post = prescale_factor, postscale_factor
        reduced = grouped_allreduce(
            [t for t, _ in packed], None, name, Compression.none, reduction, pre, post, process_set
        )
        return [compression.decompress(t, ctx) for t, (_, ctx) in zip(reduced, packed)]
    scales = (prescale_factor, postscale_factor)
    for t in tensors:
        if t.requires_grad and torch.is_grad_enabled():  # a graph to record
            return list(HorovodGroupedAllreduce.apply(reduction, name, *scales, process_set, *tensors))
    _check_adasum(reduction, process_set)  # the collective alone, no handle
    if len(tensors) == 1:  # at once where nothing else is in flight: onetensor's one call
        try:
            now = process_set._ops().allreduce_now(tensors[0], _REDUCTIONS[reduction], scales, name)
        except TensorMismatchError as err:
            raise HorovodInternalError(str(err)) from err
        if now is not None:
            return [now]
    arguments = {"op": _REDUCTIONS[reduction], "name": name, "prescale": prescale_factor, "postscale": postscale_factor}
    return list(_result(_begin("allreduce", tensors, process_set, arguments)))


allreduce = _one_result(
    grouped_allreduce, "The reduction of ``tensor`` across the set (``op``: Average by default), differentiable."
)


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: int, process_set: ProcessSet = global_process_set
) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse tensor by gathering its indices and values; call the result to wait."""
    sparse = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices = allgather_async(sparse.indices().t().contiguous(), name=f"{name}.indices", process_set=process_set)
    values = allgather_async(sparse.values(), name=f"{name}.values", process_set=process_set)

    def result() -> torch.Tensor:
        gathered_values = synchronize(values)
        gathered_indices = synchronize(indices)
        if op == Average:
            gathered_values = gathered_values / process_set.size()
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, tensor.shape)

    return result


# ---------------------------------------------------------------------- allgather
def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Start gathering ``tensors`` from every rank of the set (first dimensions may differ)."""
    return _start("allgather", tensors, process_set, _same, name=name)


class HorovodGroupedAllgather(torch.autograd.Function):
    """Grouped allgather; each gradient is this rank's rows of the averaged gradient."""

    @staticmethod
    def forward(ctx: Any, name: str | None, ps: Any, *tensors: torch.Tensor) -> Any:
        ctx.rows, ctx.ps = [t.shape[0] for t in tensors], ps
        return tuple(synchronize(grouped_allgather_async(tensors, name, ps)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        return (None, None, *[_rows_of_average(g, rows, ctx.ps) for g, rows in zip(grads, ctx.rows)])


def _rows_of_average(grad: torch.Tensor, rows: int, ps: ProcessSet) -> torch.Tensor:
    reduced = synchronize(allreduce_async(grad, op=Average, process_set=ps))
    counts = synchronize(allgather_async(torch.tensor([rows]), process_set=ps))
    start = int(counts[: ps.rank()].sum())
    return reduced.narrow(0, start, rows)


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[torch.Tensor]:
    """Every rank's ``tensors``, each concatenated along its first dimension, differentiable."""
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


allgather_async = _one_start(
    grouped_allgather_async, "Start gathering ``tensor`` from every rank of the set (first dimensions may differ)."
)
allgather = _one_result(
    grouped_allgather, "Every rank's ``tensor`` concatenated along the first dimension, differentiable."
)


# ---------------------------------------------------------------------- broadcast
def _broadcast_async(
    into_inputs: bool,
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    root = _set_rank(root_rank, process_set)
    out = [tensor] if into_inputs else None
    return _start("broadcast", [tensor], process_set, _first, root=root, name=name, out=out)


broadcast_async = _into(
    _broadcast_async, False, "Start giving every rank of the set ``root_rank``'s ``tensor`` (as a new tensor)."
)
broadcast_async_ = _into(_broadcast_async, True, ":func:`broadcast_async` into ``tensor`` itself.")
broadcast_ = _blocking(broadcast_async_, torch.Tensor, ":func:`broadcast` into ``tensor`` itself.")


def _set_rank(root_rank: int, process_set: ProcessSet) -> int:
    """A global rank's rank within ``process_set`` (Horovod's roots are global ranks)."""
    if process_set.process_set_id == 0:
        return root_rank
    if root_rank not in process_set.ranks:
        raise ValueError(f"root rank {root_rank} is not in process set {process_set.process_set_id}")
    return process_set.ranks.index(root_rank)


class HorovodBroadcast(torch.autograd.Function):
    """Broadcast; the root's gradient is the average of every rank's, the others' zero."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, ps: Any) -> Any:
        ctx.root, ctx.ps = root_rank, ps
        return synchronize(broadcast_async(tensor, root_rank, name, ps))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        averaged = synchronize(allreduce_async(grads[0], op=Average, process_set=ctx.ps))
        if rank() != ctx.root:
            averaged = averaged * 0
        return averaged, None, None, None


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank of the set (the input untouched), differentiable."""
    if tensor.requires_grad and torch.is_grad_enabled():  # a graph to record
        return HorovodBroadcast.apply(tensor, root_rank, name, process_set)
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


# ----------------------------------------------------------------------- alltoall
def _splits(splits: Any) -> list[int] | None:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError(f"alltoall splits must be a tensor of int32, got {splits.dtype}")
        return [int(s) for s in splits.tolist()]
    return [int(s) for s in splits]


def alltoall_async(
    tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Start sending ``splits[r]`` rows of ``tensor`` to rank r of the set (default: equal shares).

    Its result is (rows received, received splits as an int32 tensor)."""
    device = splits.device if isinstance(splits, torch.Tensor) else torch.device("cpu")

    def received(result: tuple[torch.Tensor, list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return result[0], torch.tensor(result[1], dtype=torch.int32, device=device)

    return _start("alltoall", [tensor], process_set, received, splits=_splits(splits), name=name)


class HorovodAlltoall(torch.autograd.Function):
    """Alltoall; its gradient goes back by the received splits."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, ps: Any) -> Any:
        output, received = synchronize(alltoall_async(tensor, splits, name, ps))
        ctx.received, ctx.ps = received, ps
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        back, _ = synchronize(alltoall_async(grads[0].contiguous(), ctx.received, None, ctx.ps))
        return back, None, None, None


def alltoall(
    tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Any:
    """The rows every rank sent this one; with ``splits``, also how many came from each (int32)."""
    return HorovodAlltoall.apply(tensor, splits, name, process_set)


# ------------------------------------------------------------------ reducescatter
def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start reducing ``tensors`` and keeping this rank's share of each first dimension."""
    if op == Adasum:
        raise HorovodInternalError("reducescatter does not support Adasum")
    reduction = _REDUCTIONS[_reduction(op, None)]
    scales = {"prescale": prescale_factor, "postscale": postscale_factor}
    return _start("reducescatter", tensors, process_set, _same, op=reduction, name=name, **scales)


def _scatter_grad(grads: Sequence[torch.Tensor], op: int, ps: ProcessSet, pre: float, post: float) -> list[Any]:
    """Reducescatter's gradient: the gradients gathered, scaled as the forward scaled."""
    factor = (ps.size() if op == Sum else 1) * pre * post
    scaled = [g * factor if factor != 1 else g for g in grads]
    return list(synchronize(grouped_allgather_async(scaled, process_set=ps)))


class HorovodGroupedReducescatter(torch.autograd.Function):
    """Grouped reducescatter; its gradients are the gathered gradients."""

    @staticmethod
    def forward(ctx: Any, name: str | None, op: int, ps: Any, pre: float, post: float, *tensors: torch.Tensor) -> Any:
        ctx.args = (op, ps, pre, post)
        return tuple(synchronize(grouped_reducescatter_async(tensors, name, op, ps, pre, post)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        return (None, None, None, None, None, *_scatter_grad(grads, *ctx.args))


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """This rank's shares of the reductions of ``tensors``, differentiable."""
    packed = [compression.compress(t) for t in tensors]
    out = HorovodGroupedReducescatter.apply(
        name, op, process_set, prescale_factor, postscale_factor, *[t for t, _ in packed]
    )
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(out, packed)]


reducescatter_async = _one_start(
    grouped_reducescatter_async, "Start reducing ``tensor`` and keeping this rank's share of the first dimension."
)
reducescatter = _one_result(grouped_reducescatter, "This rank's share of the reduction of ``tensor``, differentiable.")


# ------------------------------------------------------------------ join, barrier
def join(device: int = -1) -> int:
    """This rank has run out of data: answer the others' allreduces (with zeros) until every
    rank has joined. Returns the rank that joined last (the same on every rank)."""
    return tensor_ops(_world()).join()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of the set arrives."""
    process_set._ops().barrier()
