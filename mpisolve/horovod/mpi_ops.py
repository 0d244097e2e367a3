"""Horovod's collectives, process sets and basics, translated onto :mod:`mpisolve.comm.ops`.

Every call goes through the checked collectives of a communicator (the world, or a
process set's): a header round that every rank sees, then the data round, so a tensor
whose shape, dtype or name differs across ranks raises :class:`HorovodInternalError` on
every rank instead of hanging. An allreduce of one tensor skips the header round: the
ranks agree its signature (dtype, shape, op, prescale and postscale factors; not its name)
once, and each call with that signature is one MPI call, run when this rank waits for a
result (:mod:`mpisolve.comm.onetensor`); one whose signature differs raises on every rank.

Unlike Horovod, collectives are matched by the order in which each rank calls them, not
by name (as MPI matches them): every rank must start the collectives of one process set
in one order. Names still label the timeline, and a name already in flight on this rank
is refused.
"""

from __future__ import annotations

import atexit
import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any

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


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


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


# ---------------------------------------------------------------------- allreduce
def _allreduce_start(
    tensors: Sequence[torch.Tensor],
    then: Callable[[Any], Any],
    average: bool | None,
    name: str | None,
    op: int | None,
    scales: tuple[float, float],
    process_set: ProcessSet,
    out: Sequence[torch.Tensor] | None,
) -> int:
    reduction = _reduction(op, average)
    _check_adasum(reduction, process_set)
    pre, post = scales
    return _start(
        "allreduce",
        tensors,
        process_set,
        then,
        op=_REDUCTIONS[reduction],
        name=name,
        prescale=pre,
        postscale=post,
        out=out,
    )


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start reducing ``tensor`` (untouched) across the set; a handle for :func:`synchronize`."""
    scales = (prescale_factor, postscale_factor)
    return _allreduce_start([tensor], _first, average, name, op, scales, process_set, None)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """:func:`allreduce_async` with the result written into ``tensor``."""
    scales = (prescale_factor, postscale_factor)
    return _allreduce_start([tensor], _first, average, name, op, scales, process_set, [tensor])


class HorovodAllreduce(torch.autograd.Function):
    """Allreduce; its gradient is the same allreduce of the gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: int, name: str | None, pre: float, post: float, ps: Any) -> Any:
        ctx.args = (op, pre, post, ps)
        return synchronize(allreduce_async(tensor, None, name, op, pre, post, ps))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        op, pre, post, ps = ctx.args
        return synchronize(allreduce_async(grads[0], None, None, op, pre, post, ps)), None, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """The reduction of ``tensor`` across the set (``op``: Average by default), differentiable."""
    compressed, ctx = compression.compress(tensor)
    reduction = _reduction(op, average)
    if compressed.requires_grad and torch.is_grad_enabled():
        reduced = HorovodAllreduce.apply(compressed, reduction, name, prescale_factor, postscale_factor, process_set)
    else:  # no graph to record: the collective alone, no handle
        _check_adasum(reduction, process_set)
        ops = process_set._ops()
        try:  # at once where nothing else is in flight: onetensor's one call, no handle or call object
            now = ops.allreduce_now(compressed, _REDUCTIONS[reduction], (prescale_factor, postscale_factor), name)
        except TensorMismatchError as err:
            raise HorovodInternalError(str(err)) from err
        if now is not None:
            return compression.decompress(now, ctx)
        arguments = {"op": _REDUCTIONS[reduction], "name": name, "prescale": prescale_factor}
        arguments["postscale"] = postscale_factor
        reduced = _result(_begin("allreduce", [compressed], process_set, arguments))[0]
    return compression.decompress(reduced, ctx)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """:func:`allreduce` in place (not differentiable)."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start reducing ``tensors`` as one call (fused by dtype)."""
    scales = (prescale_factor, postscale_factor)
    return _allreduce_start(tensors, _same, average, name, op, scales, process_set, None)


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """:func:`grouped_allreduce_async` with the results written into ``tensors``."""
    scales = (prescale_factor, postscale_factor)
    return _allreduce_start(tensors, _same, average, name, op, scales, process_set, list(tensors))


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
    """The reductions of ``tensors`` as one call, differentiable."""
    packed = [compression.compress(t) for t in tensors]
    reduced = HorovodGroupedAllreduce.apply(
        _reduction(op, average), name, prescale_factor, postscale_factor, process_set, *[t for t, _ in packed]
    )
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(reduced, packed)]


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """:func:`grouped_allreduce` in place."""
    return synchronize(
        grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
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
def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    """Start gathering ``tensor`` from every rank of the set (first dimensions may differ)."""
    return _start("allgather", [tensor], process_set, _first, name=name)


class HorovodAllgather(torch.autograd.Function):
    """Allgather; its gradient is this rank's rows of the averaged gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, ps: Any) -> Any:
        ctx.rows, ctx.ps = tensor.shape[0], ps
        return synchronize(allgather_async(tensor, name, ps))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        return _rows_of_average(grads[0], ctx.rows, ctx.ps), None, None


def _rows_of_average(grad: torch.Tensor, rows: int, ps: ProcessSet) -> torch.Tensor:
    reduced = synchronize(allreduce_async(grad, op=Average, process_set=ps))
    counts = synchronize(allgather_async(torch.tensor([rows]), process_set=ps))
    start = int(counts[: ps.rank()].sum())
    return reduced.narrow(0, start, rows)


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension, differentiable."""
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
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


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[torch.Tensor]:
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


# ---------------------------------------------------------------------- broadcast
def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Start giving every rank of the set ``root_rank``'s ``tensor`` (as a new tensor)."""
    return _start("broadcast", [tensor], process_set, _first, root=_set_rank(root_rank, process_set), name=name)


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """:func:`broadcast_async` into ``tensor`` itself."""
    root = _set_rank(root_rank, process_set)
    return _start("broadcast", [tensor], process_set, _first, root=root, name=name, out=[tensor])


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
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """:func:`broadcast` into ``tensor`` itself."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


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
def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start reducing ``tensor`` and keeping this rank's share of the first dimension."""
    return _reducescatter_start([tensor], _first, name, op, process_set, (prescale_factor, postscale_factor))


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    return _reducescatter_start(tensors, _same, name, op, process_set, (prescale_factor, postscale_factor))


def _reducescatter_start(
    tensors: Sequence[torch.Tensor],
    then: Callable[[Any], Any],
    name: str | None,
    op: int,
    process_set: ProcessSet,
    scales: tuple[float, float],
) -> int:
    if op == Adasum:
        raise HorovodInternalError("reducescatter does not support Adasum")
    reduction = _REDUCTIONS[_reduction(op, None)]
    pre, post = scales
    return _start("reducescatter", tensors, process_set, then, op=reduction, name=name, prescale=pre, postscale=post)


def _scatter_grad(grads: Sequence[torch.Tensor], op: int, ps: ProcessSet, pre: float, post: float) -> list[Any]:
    """Reducescatter's gradient: the gradients gathered, scaled as the forward scaled."""
    factor = (ps.size() if op == Sum else 1) * pre * post
    scaled = [g * factor if factor != 1 else g for g in grads]
    return list(synchronize(grouped_allgather_async(scaled, process_set=ps)))


class HorovodReducescatter(torch.autograd.Function):
    """Reducescatter; its gradient is the gathered gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: int, ps: Any, pre: float, post: float) -> Any:
        ctx.args = (op, ps, pre, post)
        return synchronize(reducescatter_async(tensor, name, op, ps, pre, post))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        return _scatter_grad(grads, *ctx.args)[0], None, None, None, None, None


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """This rank's share of the reduction of ``tensor``, differentiable."""
    compressed, ctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


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
    packed = [compression.compress(t) for t in tensors]
    out = HorovodGroupedReducescatter.apply(
        name, op, process_set, prescale_factor, postscale_factor, *[t for t, _ in packed]
    )
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(out, packed)]


# ------------------------------------------------------------------ join, barrier
def join(device: int = -1) -> int:
    """This rank has run out of data: answer the others' allreduces (with zeros) until every
    rank has joined. Returns the rank that joined last (the same on every rank)."""
    return tensor_ops(_world()).join()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of the set arrives."""
    process_set._ops().barrier()
