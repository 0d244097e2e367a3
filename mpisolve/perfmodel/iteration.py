"""One training iteration of each solver: compute plus the communication it cannot hide.

For a workload of ``n = params x wire_bytes`` bytes of gradients at ``p`` ranks, each
solver's communication per iteration (amortised over the steps between exchanges):

- ``allreduce``, ``lb-bsp``: one allreduce of n per update, in buckets of ``bucket_mb``
  (each bucket pays its own latency terms); ``abs-sgd`` the same, waiting only for what
  outlasts a step's compute (its ranks compute micro-batches until the allreduce ends),
  and at several ranks its round's passes over the model (:data:`ABS_SGD_ROUND_BYTES`);
- ``adasum``: the Adasum VHDD of n per update (:func:`.network.adasum_allreduce`: the
  halving-doubling volume, a small allreduce of per-tensor statistics at each level, and
  ``gamma_adasum`` per byte), and at several ranks its host work a step where measured
  (:attr:`Case.host_s_per_byte`: the delta's passes over the model);
- ``easgd``, ``local-sgd``: an allreduce of n every ``tau`` steps;
- the window solvers (``async-*``, ``hogwild-sgd``, ``ea-wild``): every ``tau`` steps a
  worker reads the shared vector and accumulates into it, n bytes each way, from the
  p - 1 other ranks' shards (``layout=sharded``), or all of it from rank 0 (``server``,
  whose link then carries every worker's 2n); locked solvers add a lock and an unlock per
  shard (:func:`.network.window_exchange`). The case's ``window`` networks (alpha and
  beta fitted to ``bench windows``, one per mode: ``locked``, ``wild``) price it when
  given, else the allreduce's network does. Nobody waits for anybody, so no idle time;
- ``kfac``: the gradient allreduce of n per update; every ``factor_update_steps`` the
  covariance of each layer's factors (2 m B d^2 flops for m rows per sample) and an
  allreduce of the factors (upper triangles with ``pack_triangles``); every
  ``inv_update_steps`` the inversions (``inverse_cost`` d^3 flops each, the largest
  first on the least loaded rank; every rank inverts everything for ``d-kfac``) and a
  broadcast of each inverse from its owner (modelled as one allgather); each update, the
  preconditioning (2 a g (a + g) flops per layer).

Without overlap (the default) every exchange is waited for: an upper bound of the cost.
With ``Case.overlap`` the bucketed exchanges follow backward (:func:`backward_timeline`,
backward being 2/3 of the compute) and only what outlasts it is waited for.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import InputError
from ..options import BucketOptions, LocalStepsOptions, build_options, option, parse_option, require, with_default
from .network import Network, adasum_allreduce, adasum_levels, allgather, window_exchange
from .sharing import SharedCores
from .workloads import Workload

BACKWARD_SHARE = 2 / 3
#: Bytes abs-sgd's round moves per gradient byte each micro-batch at several ranks, beyond
#: what its one-rank step moves (mpisolve/solvers/abs_sgd.py, default options): the flat
#: gradients zeroed (1) and accumulated into by backward (3), added to the round's sum (3),
#: the sum zeroed (1) and copied into and out of the node-shared sum (4), the mean written
#: back (2), the weight prediction (the true weights back 2, the update 3, the new true
#: weights 2, the prediction 3).
ABS_SGD_ROUND_BYTES = 24
#: ``fusion="cycle"``: the loop's phase against backward is uniform; its exposure is the
#: mean over this many evenly spaced phases (the midpoints of equal shares of a tick).
CYCLE_PHASES = 8


@dataclass(frozen=True, kw_only=True)
class Compute:
    """One rank's compute: ``step_s`` seconds for forward, backward and optimizer step
    on its batch of ``batch`` samples alone; flop rates for K-FAC's matrix products and
    inversions; ``sharing``: the ranks share cores (:mod:`.sharing`), None for a
    processor per rank."""

    step_s: float
    batch: int
    gemm_flops: float = 50e12
    inverse_flops: float = 2e12
    sharing: SharedCores | None = None

    def __post_init__(self) -> None:
        require(math.isfinite(self.step_s) and self.step_s > 0, f"step time must be > 0 s, got {self.step_s}")
        require(self.batch >= 1, f"batch must be >= 1, got {self.batch}")
        require(self.gemm_flops > 0 and self.inverse_flops > 0, "flop rates must be > 0")

    def slowdown(self, p: int) -> float:
        """How much slower each rank computes at p ranks on this machine."""
        return 1.0 if self.sharing is None else self.sharing.slowdown(p)

    def seconds(self, p: int) -> float:
        """One rank's step at p ranks."""
        return self.step_s * self.slowdown(p)


@dataclass(frozen=True)
class Exchange:
    """A solver's model's answer: extra compute, communication, and the part of it waited for (seconds)."""

    extra: float
    comm: float
    exposed: float


@dataclass(frozen=True)
class Iteration:
    compute: float  # seconds of computing, per iteration
    comm: float  # seconds of communication, per iteration (amortised)
    exposed: float  # the part of comm not hidden behind backward

    @property
    def total(self) -> float:
        return self.compute + self.exposed


@dataclass(frozen=True, kw_only=True)
class GradientOptions(BucketOptions):
    """``fusion``: how gradients are grouped as backward produces them (:func:`backward_timeline`);
    ``cycle_ms`` and ``negotiation``: Horovod's background loop, for ``fusion="cycle"``."""

    fusion: Literal["buckets", "ready", "cycle"] = "buckets"
    cycle_ms: float = option(
        5.0,
        "fusion=cycle: the background loop's sleep before each tick, ms (Horovod 0.9-0.13.3: a fixed 5 ms sleep; "
        "HOROVOD_CYCLE_TIME from 0.13.4, default 5)",
        at_least=0,
    )
    negotiation: bool = option(
        True,
        "fusion=cycle: each tick rank 0 receives every rank's ready list and DONE and sends each fused response "
        "and its DONE to every rank, one point-to-point message each at the network's alpha "
        "(Horovod 0.9-0.13.2; MPI_Gather from 0.13.3)",
    )


@dataclass(frozen=True, kw_only=True)
class WindowOptions(LocalStepsOptions):
    """``layout``: "sharded" (each rank owns a slice of the shared vector) or "server" (rank 0)."""

    layout: Literal["sharded", "server"] = "sharded"


@dataclass(frozen=True, kw_only=True)
class EveryStepWindowOptions(WindowOptions):
    """The window of the solvers that push every step by default."""

    tau: int = with_default(LocalStepsOptions, "tau", 1)


@dataclass(frozen=True, kw_only=True)
class KFACModelOptions(GradientOptions):
    """As the kfac solver's options of these names; ``inverse_cost``: flops of one
    inversion per d^3 (about 1 for a Cholesky inverse, 5-10 for an eigendecomposition)."""

    variant: Literal["d-kfac", "mpd-kfac", "spd-kfac"] = "spd-kfac"
    factor_update_steps: int = 10
    inv_update_steps: int = 100
    pack_triangles: bool | None = None
    inverse_cost: float = 1.0
    inverse_ms: float = option(
        0.0,
        "an inversion of a d x d factor takes inverse_ms * exp(inverse_growth * d) ms (the SPD-KFAC authors' fit "
        "of their GPUs' inversion times: 3.64 and 4.77e-4); 0: inverse_cost d^3 flops at --inverse-tflops",
        at_least=0,
    )
    inverse_growth: float = option(0.0, "see inverse_ms: the growth of an inversion's time per dimension", at_least=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.factor_update_steps >= 1, f"factor_update_steps must be >= 1, got {self.factor_update_steps}")
        require(self.inv_update_steps >= 1, f"inv_update_steps must be >= 1, got {self.inv_update_steps}")
        require(
            math.isfinite(self.inverse_cost) and self.inverse_cost > 0,
            f"inverse_cost must be > 0, got {self.inverse_cost}",
        )
        require(
            self.inverse_growth == 0 or self.inverse_ms > 0,
            f"inverse_growth goes with inverse_ms > 0, got inverse_growth={self.inverse_growth}, inverse_ms=0",
        )


@dataclass(frozen=True)
class Case:
    """What a solver's model is given. ``window``: the networks that price window
    exchanges, by mode ("locked", "wild"; fitted to ``bench windows``), None for ``net``;
    ``overlap``: bucketed exchanges start as backward produces their gradients (else all
    of them wait for backward's end: an upper bound of the cost); ``host_s_per_byte`` and
    ``host_s``: the solver's own host work a micro-batch at several ranks, which its
    one-rank step skips (abs-sgd's round bookkeeping, Adasum's delta), per gradient byte
    (None: the solver model's default) and fixed, as measured on a machine."""

    workload: Workload
    net: Network
    compute: Compute
    p: int
    wire_bytes: int
    gamma_adasum: float
    window: Mapping[str, Network] | None = None
    overlap: bool = False
    host_s_per_byte: float | None = None
    host_s: float = 0.0

    @property
    def grad_bytes(self) -> float:
        return float(self.workload.params * self.wire_bytes)

    def host_work(self, default_s_per_byte: float = 0.0) -> float:
        """The solver's host work a micro-batch at ``p`` ranks (none at one), per byte
        ``host_s_per_byte`` where measured, else ``default_s_per_byte``; slowed as the
        compute is by shared cores."""
        if self.p == 1:
            return 0.0
        per_byte = default_s_per_byte if self.host_s_per_byte is None else self.host_s_per_byte
        return (self.host_s + per_byte * self.grad_bytes) * self.compute.slowdown(self.p)


def _bucket_sizes(case: Case, bucket_mb: float) -> list[float]:
    """Bytes of each bucket of ``bucket_mb`` the gradients fill."""
    bucket = bucket_mb * 2**20
    full, rest = divmod(case.grad_bytes, bucket)
    return [bucket] * int(full) + ([rest] if rest else [])


def _bucketed(case: Case, bucket_mb: float, each: Callable[[float], float]) -> float:
    """``each(bytes)`` summed over the buckets of ``bucket_mb`` the gradients fill."""
    return sum(each(n) for n in _bucket_sizes(case, bucket_mb))


def backward_timeline(case: Case, options: GradientOptions, each: Callable[[float], float]) -> tuple[float, float]:
    """Seconds from the start of backward to the end of the last gradient exchange, and
    the exchanges' seconds in all.

    Backward goes through the layers last to first, each taking a share of it in
    proportion to its flops; a layer's gradients (bytes in proportion to its weights) are
    then ready. ``fusion="buckets"`` (the solvers', and PyTorch DDP's): they join the open
    bucket, sent once the network has finished the one before, when the next layer's would
    take it past ``bucket_mb`` (a layer larger than that goes alone). ``fusion="ready"``
    (Horovod's tensor fusion): whenever the network is free, one exchange takes every
    gradient ready by then, up to ``bucket_mb`` (at least one layer's). ``fusion="cycle"``:
    Horovod's background loop as its code of the 512-GPU benchmark ran it
    (:func:`cycle_timeline`).
    """
    if options.fusion == "cycle":
        return cycle_timeline(case, options, each)
    backward, ready = _ready(case)
    limit = options.bucket_mb * 2**20
    free = busy = 0.0
    if options.fusion == "ready":
        i = 0
        while i < len(ready):
            start = max(free, ready[i][0])
            size = 0.0
            while i < len(ready) and ready[i][0] <= start and (not size or size + ready[i][1] <= limit):
                size += ready[i][1]
                i += 1
            busy += each(size)
            free = start + each(size)
        return max(free, backward), busy
    size = last = 0.0
    for at, nbytes in ready:
        if size and size + nbytes > limit:
            busy += each(size)
            free = max(free, last) + each(size)
            size = 0.0
        size, last = size + nbytes, at
    busy += each(size)
    return max(max(free, last) + each(size), backward), busy


def _ready(case: Case, *, at_end: bool = False) -> tuple[float, list[tuple[float, float]]]:
    """Backward's seconds, and when each layer's gradients are ready (last layer first; all
    at backward's end with ``at_end``) with their bytes."""
    layers = case.workload.layers[::-1]
    flops = sum(layer.flops for layer in layers)
    weights = sum(layer.a_dim * layer.g_dim for layer in layers)
    backward = BACKWARD_SHARE * case.compute.seconds(case.p)
    ready, clock = [], 0.0
    for layer in layers:
        clock += backward * layer.flops / flops
        ready.append((backward if at_end else clock, case.grad_bytes * layer.a_dim * layer.g_dim / weights))
    return backward, ready


def cycle_timeline(case: Case, options: GradientOptions, each: Callable[[float], float]) -> tuple[float, float]:
    """:func:`backward_timeline` for Horovod's background loop (horovod/common/operations.cc, 0.9-0.13.2).

    The loop runs apart from backward, tick after tick: it sleeps ``cycle_ms``, then takes
    the gradients ready by then. With ``negotiation``, every other rank sends rank 0 its
    ready list and a DONE message; rank 0 fuses the ready gradients in order while they fit
    in ``bucket_mb`` (a larger one alone), sends each fused response to every rank and then
    a DONE: ``3 (p - 1)`` messages a tick that has gradients, ``2 (p - 1)`` one that has
    none, and ``p - 1`` a response, each at the network's alpha. Each response's allreduce
    is queued on the GPU's stream as it is sent, without waiting for the one before to end
    (NCCL), so the exchanges run back to back in that order. The loop's phase against
    backward is uniform: the result is the mean over :data:`CYCLE_PHASES` phases. Without
    ``case.overlap`` every gradient is ready at backward's end.
    """
    backward, ready = _ready(case, at_end=not case.overlap)
    limit = options.bucket_mb * 2**20
    message = case.net.at(case.p).alpha * (case.p - 1) if options.negotiation else 0.0
    cycle = options.cycle_ms * 1e-3
    idle = cycle + 2 * message
    end = busy = 0.0
    for phase in range(CYCLE_PHASES):
        collect = (phase + 0.5) / CYCLE_PHASES * idle
        i, free = 0, 0.0
        while i < len(ready):
            if ready[i][0] > collect:  # the ticks that find nothing ready, passed at once
                collect = ready[i][0] if idle == 0 else collect + math.ceil((ready[i][0] - collect) / idle) * idle
            tick = collect
            sizes: list[float] = []
            while i < len(ready) and ready[i][0] <= collect:
                if sizes and sizes[-1] + ready[i][1] <= limit:
                    sizes[-1] += ready[i][1]
                else:
                    sizes.append(ready[i][1])
                i += 1
            tick += 3 * message if sizes else 2 * message
            for size in sizes:
                tick += message
                seconds = each(size)
                free = max(free, tick) + seconds
                busy += seconds
            collect = tick + cycle
        end += max(free, backward)
    return end / CYCLE_PHASES, busy / CYCLE_PHASES


def _gradients(case: Case, options: GradientOptions, each: Callable[[float], float]) -> tuple[float, float]:
    """The gradient exchange's seconds in all and the part of them the iteration waits for:
    every bucket after backward (Horovod's loop: its ticks from backward's end), or with
    ``case.overlap`` what the backward timeline leaves after backward."""
    if not case.overlap and options.fusion != "cycle":
        comm = _bucketed(case, options.bucket_mb, each)
        return comm, comm
    end, comm = backward_timeline(case, options, each)
    return comm, end - BACKWARD_SHARE * case.compute.seconds(case.p)


def _waits(case: Case, exchanges: float = 0.0, locks: float = 0.0) -> float:
    """What blocking exchanges and lock acquisitions add where ranks share cores."""
    sharing = case.compute.sharing
    return 0.0 if sharing is None else sharing.waits(case.p, exchanges) + sharing.locks(case.p, locks)


def _allreduce(case: Case, options: GradientOptions) -> Exchange:
    def each(n: float) -> float:
        return case.net.allreduce(case.p, n)

    comm, exposed = _gradients(case, options, each)
    waits = _waits(case, len(_bucket_sizes(case, options.bucket_mb)))
    return Exchange(0.0, comm + waits, exposed + waits)


def _abs_sgd(case: Case, options: GradientOptions) -> Exchange:
    """ABS-SGD computes micro-batches until its delayed allreduce completes: only what
    outlasts a step's compute is waited for; with its bounded rounds (one micro-batch a
    round, the default) each step still waits for the round before, a blocking exchange.
    At several ranks each micro-batch also does its round's bookkeeping (:meth:`Case.host_work`;
    unmeasured, :data:`ABS_SGD_ROUND_BYTES` moved at the network's reduction speed: ``gamma``
    reduces a byte by moving three)."""
    comm = _bucketed(case, options.bucket_mb, lambda n: case.net.allreduce(case.p, n))
    waits = _waits(case, len(_bucket_sizes(case, options.bucket_mb)))
    rounds = case.host_work(ABS_SGD_ROUND_BYTES * case.net.gamma / 3)
    return Exchange(rounds, comm + waits, max(0.0, comm - case.compute.seconds(case.p)) + waits)


def _adasum(case: Case, options: GradientOptions) -> Exchange:
    share = case.workload.tensors / max(case.grad_bytes, 1.0)  # tensors per byte, spread over buckets

    def each(n: float) -> float:
        return adasum_allreduce(case.net, case.p, n, tensors=max(1, round(n * share)), gamma_adasum=case.gamma_adasum)

    comm, exposed = _gradients(case, options, each)
    # Where ranks share cores each level of a bucket is a blocking exchange: a partner may be
    # off its core at every level, not only at the first (the calibration's Adasum runs).
    waits = _waits(case, len(_bucket_sizes(case, options.bucket_mb)) * adasum_levels(case.p))
    return Exchange(case.host_work(), comm + waits, exposed + waits)


def _easgd(case: Case, options: LocalStepsOptions) -> Exchange:
    comm = (case.net.allreduce(case.p, case.grad_bytes) + _waits(case, 1.0)) / options.tau
    return Exchange(0.0, comm, comm)


def _window(locked: bool) -> Callable[[Case, WindowOptions], Exchange]:
    mode = "locked" if locked else "wild"

    def model(case: Case, options: WindowOptions) -> Exchange:
        net = case.window[mode] if case.window is not None else case.net
        comm = window_exchange(net, case.p, case.grad_bytes, locked=locked, layout=options.layout)
        if locked:  # a lock per shard for the read and one for the accumulate
            comm += _waits(case, locks=2.0 if options.layout == "server" else 2.0 * (case.p - 1))
        return Exchange(0.0, comm / options.tau, comm / options.tau)

    return model


def _inversion_s(options: KFACModelOptions, compute: Compute, d: int) -> float:
    """Seconds to invert one d x d factor: the fitted exponential where ``inverse_ms`` is given, else by flops."""
    if options.inverse_ms:
        return options.inverse_ms * 1e-3 * math.exp(options.inverse_growth * d)
    return options.inverse_cost * d**3 / compute.inverse_flops


def _kfac(case: Case, options: KFACModelOptions) -> Exchange:
    """K-FAC's extra compute and communication per iteration, amortised.

    With ``case.overlap``, the gradients follow the backward timeline; ``spd-kfac``
    pipelines its factor allreduces with forward and backward, so that only what the
    network cannot fit into the step (with the gradients) is waited for; the other
    variants allreduce the factors after backward.
    """
    p, net, layers, compute = case.p, case.net, case.workload.layers, case.compute
    pack = options.variant == "spd-kfac" if options.pack_triangles is None else options.pack_triangles
    dims = [d for layer in layers for d in (layer.a_dim, layer.g_dim)]
    elements = sum(d * (d + 1) // 2 if pack else d * d for d in dims)
    factor_flops = sum(2 * compute.batch * layer.positions * (layer.a_dim**2 + layer.g_dim**2) for layer in layers)
    precondition_flops = sum(2 * layer.a_dim * layer.g_dim * (layer.a_dim + layer.g_dim) for layer in layers)
    inversions = sorted((_inversion_s(options, compute, d) for d in dims), reverse=True)
    if options.variant == "d-kfac" or p == 1:
        inverse_s, inverse_comm = sum(inversions), 0.0
    else:
        loads = [0.0] * p
        for cost in inversions:  # largest first on the least loaded rank
            heapq.heapreplace(loads, loads[0] + cost)
        inverse_s = max(loads)
        inverse_comm = allgather(net, p, sum(d * d for d in dims) * case.wire_bytes)
    share = compute.slowdown(p)
    extra = factor_flops / compute.gemm_flops * share / options.factor_update_steps
    extra += inverse_s * share / options.inv_update_steps + precondition_flops / compute.gemm_flops * share

    def each(n: float) -> float:
        return net.allreduce(p, n)

    grads, grads_exposed = _gradients(case, options, each)
    waits = _waits(case, len(_bucket_sizes(case, options.bucket_mb)))
    grads, grads_exposed = grads + waits, grads_exposed + waits
    factors = (net.allreduce(p, elements * case.wire_bytes) + _waits(case, 1.0)) / options.factor_update_steps
    inverses = (inverse_comm + (_waits(case, 1.0) if inverse_comm else 0.0)) / options.inv_update_steps
    exposed = grads_exposed
    if case.overlap and options.variant == "spd-kfac":
        exposed = max(exposed, grads + factors - compute.seconds(p)) + inverses
    else:
        exposed += factors + inverses
    return Exchange(extra, grads + factors + inverses, exposed)


#: solver -> (its model: extra compute, communication and what of it is waited for, per iteration; its options).
MODELS: dict[str, tuple[Callable[[Case, Any], Exchange], type]] = {
    "allreduce": (_allreduce, GradientOptions),
    "abs-sgd": (_abs_sgd, GradientOptions),
    "adasum": (_adasum, GradientOptions),
    "easgd": (_easgd, LocalStepsOptions),
    "local-sgd": (_easgd, LocalStepsOptions),  # an allreduce of the parameters every tau steps
    "lb-bsp": (_allreduce, GradientOptions),  # batch sizes balance the ranks' compute; the exchange is allreduce's
    "async-sgd": (_window(locked=True), EveryStepWindowOptions),
    "async-msgd": (_window(locked=True), EveryStepWindowOptions),
    "hogwild-sgd": (_window(locked=False), EveryStepWindowOptions),
    "async-easgd": (_window(locked=True), WindowOptions),
    "async-measgd": (_window(locked=True), WindowOptions),
    "ea-wild": (_window(locked=False), WindowOptions),
    "kfac": (_kfac, KFACModelOptions),
}


def model_options(solver: str, given: Mapping[str, Any]) -> Any:
    """The validated options of ``solver``'s model (values already typed)."""
    if solver not in MODELS:
        raise InputError(f"no performance model for solver {solver!r} (modelled: {', '.join(MODELS)})")
    return build_options(solver, MODELS[solver][1], dict(given))


def parse_model_option(solver: str, item: str) -> tuple[str, Any]:
    """``key=value`` (from ``--set``) typed as ``solver``'s model option ``key``."""
    if solver not in MODELS:
        raise InputError(f"no performance model for solver {solver!r} (modelled: {', '.join(MODELS)})")
    key, sep, text = item.partition("=")
    if not sep:
        raise InputError(f"--set wants key=value, got {item!r}")
    return key, parse_option(solver, MODELS[solver][1], key, text)


def iteration(solver: str, case: Case, options: Any = None) -> Iteration:
    """The modelled iteration of ``solver`` in ``case`` (``options`` from :func:`model_options`)."""
    options = model_options(solver, {}) if options is None else options
    exchange = MODELS[solver][0](case, options)
    return Iteration(case.compute.seconds(case.p) + exchange.extra, exchange.comm, exchange.exposed)
