"""One training iteration of each solver: compute plus the communication it cannot hide.

For a workload of ``n = params x wire_bytes`` bytes of gradients at ``p`` ranks, each
solver's communication per iteration (amortised over the steps between exchanges):

- ``allreduce``, ``abs-sgd``, ``lb-bsp``: one allreduce of n per update, in buckets of ``bucket_mb``
  (each bucket pays its own latency terms);
- ``adasum``: the Adasum VHDD of n per update (:func:`.network.adasum_allreduce`: the
  halving-doubling volume, a small allreduce of per-tensor statistics at each level, and
  ``gamma_adasum`` per byte);
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

The exposed communication is ``max(0, comm - overlap x backward)``, backward being 2/3 of
the compute; ``overlap=0`` (the default) hides nothing: an upper bound of the cost.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import InputError
from ..options import BucketOptions, LocalStepsOptions, build_options, parse_option, require, with_default
from .network import Network, adasum_allreduce, allgather, window_exchange
from .workloads import Workload

BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True, kw_only=True)
class Compute:
    """One rank's compute: ``step_s`` seconds for forward, backward and optimizer step
    on its batch of ``batch`` samples; flop rates for K-FAC's matrix products and
    inversions; ``cores``: ranks beyond this many share them (step time scales with
    ranks / cores), None for a processor per rank."""

    step_s: float
    batch: int
    gemm_flops: float = 50e12
    inverse_flops: float = 2e12
    cores: int | None = None

    def __post_init__(self) -> None:
        require(math.isfinite(self.step_s) and self.step_s > 0, f"step time must be > 0 s, got {self.step_s}")
        require(self.batch >= 1, f"batch must be >= 1, got {self.batch}")
        require(self.gemm_flops > 0 and self.inverse_flops > 0, "flop rates must be > 0")
        require(self.cores is None or self.cores >= 1, f"cores must be >= 1, got {self.cores}")

    def share(self, p: int) -> float:
        """How much slower each rank computes at p ranks on this machine."""
        return 1.0 if self.cores is None else max(1.0, p / self.cores)


@dataclass(frozen=True)
class Iteration:
    compute: float  # seconds of computing, per iteration
    comm: float  # seconds of communication, per iteration (amortised)
    exposed: float  # the part of comm not hidden behind backward

    @property
    def total(self) -> float:
        return self.compute + self.exposed


@dataclass(frozen=True, kw_only=True)
class WindowOptions(LocalStepsOptions):
    """``layout``: "sharded" (each rank owns a slice of the shared vector) or "server" (rank 0)."""

    layout: Literal["sharded", "server"] = "sharded"


@dataclass(frozen=True, kw_only=True)
class EveryStepWindowOptions(WindowOptions):
    """The window of the solvers that push every step by default."""

    tau: int = with_default(LocalStepsOptions, "tau", 1)


@dataclass(frozen=True, kw_only=True)
class KFACModelOptions(BucketOptions):
    """As the kfac solver's options of these names; ``inverse_cost``: flops of one
    inversion per d^3 (about 1 for a Cholesky inverse, 5-10 for an eigendecomposition)."""

    variant: Literal["d-kfac", "mpd-kfac", "spd-kfac"] = "spd-kfac"
    factor_update_steps: int = 10
    inv_update_steps: int = 100
    pack_triangles: bool | None = None
    inverse_cost: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.factor_update_steps >= 1, f"factor_update_steps must be >= 1, got {self.factor_update_steps}")
        require(self.inv_update_steps >= 1, f"inv_update_steps must be >= 1, got {self.inv_update_steps}")
        require(
            math.isfinite(self.inverse_cost) and self.inverse_cost > 0,
            f"inverse_cost must be > 0, got {self.inverse_cost}",
        )


@dataclass(frozen=True)
class Case:
    """What a solver's model is given. ``window``: the networks that price window
    exchanges, by mode ("locked", "wild"; fitted to ``bench windows``), None for ``net``."""

    workload: Workload
    net: Network
    compute: Compute
    p: int
    wire_bytes: int
    gamma_adasum: float
    window: Mapping[str, Network] | None = None

    @property
    def grad_bytes(self) -> float:
        return float(self.workload.params * self.wire_bytes)


def _bucketed(case: Case, bucket_mb: float, each: Callable[[float], float]) -> float:
    """``each(bytes)`` summed over the buckets of ``bucket_mb`` the gradients fill."""
    bucket = bucket_mb * 2**20
    full, rest = divmod(case.grad_bytes, bucket)
    return full * each(bucket) + (each(rest) if rest else 0.0)


def _allreduce(case: Case, options: BucketOptions) -> tuple[float, float]:
    return 0.0, _bucketed(case, options.bucket_mb, lambda n: case.net.allreduce(case.p, n))


def _adasum(case: Case, options: BucketOptions) -> tuple[float, float]:
    share = case.workload.tensors / max(case.grad_bytes, 1.0)  # tensors per byte, spread over buckets
    return 0.0, _bucketed(
        case,
        options.bucket_mb,
        lambda n: adasum_allreduce(
            case.net, case.p, n, tensors=max(1, round(n * share)), gamma_adasum=case.gamma_adasum
        ),
    )


def _easgd(case: Case, options: LocalStepsOptions) -> tuple[float, float]:
    return 0.0, case.net.allreduce(case.p, case.grad_bytes) / options.tau


def _window(locked: bool) -> Callable[[Case, WindowOptions], tuple[float, float]]:
    mode = "locked" if locked else "wild"

    def model(case: Case, options: WindowOptions) -> tuple[float, float]:
        net = case.window[mode] if case.window is not None else case.net
        exchange = window_exchange(net, case.p, case.grad_bytes, locked=locked, layout=options.layout)
        return 0.0, exchange / options.tau

    return model


def _kfac(case: Case, options: KFACModelOptions) -> tuple[float, float]:
    """(extra compute, communication) of K-FAC per iteration, amortised."""
    p, net, layers, compute = case.p, case.net, case.workload.layers, case.compute
    pack = options.variant == "spd-kfac" if options.pack_triangles is None else options.pack_triangles
    dims = [d for layer in layers for d in (layer.a_dim, layer.g_dim)]
    elements = sum(d * (d + 1) // 2 if pack else d * d for d in dims)
    factor_flops = sum(2 * compute.batch * layer.positions * (layer.a_dim**2 + layer.g_dim**2) for layer in layers)
    precondition_flops = sum(2 * layer.a_dim * layer.g_dim * (layer.a_dim + layer.g_dim) for layer in layers)
    inversions = sorted((options.inverse_cost * d**3 for d in dims), reverse=True)
    if options.variant == "d-kfac" or p == 1:
        inverse_s, inverse_comm = sum(inversions) / compute.inverse_flops, 0.0
    else:
        loads = [0.0] * p
        for cost in inversions:  # largest first on the least loaded rank
            heapq.heapreplace(loads, loads[0] + cost)
        inverse_s = max(loads) / compute.inverse_flops
        inverse_comm = allgather(net, p, sum(d * d for d in dims) * case.wire_bytes)
    share = compute.share(p)
    extra = factor_flops / compute.gemm_flops * share / options.factor_update_steps
    extra += inverse_s * share / options.inv_update_steps + precondition_flops / compute.gemm_flops * share
    comm = _bucketed(case, options.bucket_mb, lambda n: net.allreduce(p, n))
    comm += (
        net.allreduce(p, elements * case.wire_bytes) / options.factor_update_steps
        + inverse_comm / options.inv_update_steps
    )
    return extra, comm


#: solver -> (its model: (extra compute, communication) in seconds per iteration, its options).
MODELS: dict[str, tuple[Callable[[Case, Any], tuple[float, float]], type]] = {
    "allreduce": (_allreduce, BucketOptions),
    "abs-sgd": (_allreduce, BucketOptions),
    "adasum": (_adasum, BucketOptions),
    "easgd": (_easgd, LocalStepsOptions),
    "local-sgd": (_easgd, LocalStepsOptions),  # an allreduce of the parameters every tau steps
    "lb-bsp": (_allreduce, BucketOptions),  # batch sizes balance the ranks' compute; the exchange is allreduce's
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


def iteration(solver: str, case: Case, options: Any = None, *, overlap: float = 0.0) -> Iteration:
    """The modelled iteration of ``solver`` in ``case`` (``options`` from :func:`model_options`)."""
    options = model_options(solver, {}) if options is None else options
    require(0.0 <= overlap <= 1.0, f"overlap must be in [0, 1], got {overlap}")
    extra, comm = MODELS[solver][0](case, options)
    compute = case.compute.step_s * case.compute.share(case.p) + extra
    hidden = overlap * BACKWARD_SHARE * case.compute.step_s * case.compute.share(case.p)
    return Iteration(compute, comm, max(0.0, comm - hidden))
