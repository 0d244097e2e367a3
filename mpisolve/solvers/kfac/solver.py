"""The "kfac" solver: distributed K-FAC in three variants, D-KFAC, MPD-KFAC and SPD-KFAC.

Gradients are averaged across ranks exactly as by the allreduce solver (the same fused
gradient buckets, reduced while backward runs). Linear and Conv2d layers then have their
averaged gradients replaced by the K-FAC preconditioned ones; every other parameter keeps
its averaged gradient; the user's optimizer steps.

The variants differ in how the factor work is spread and communicated, not in the math
(they give the same parameters):

- ``d-kfac``: factors allreduced in one message after backward; every rank inverts every
  factor.
- ``mpd-kfac``: the same factor allreduce; inversions spread round-robin over the ranks,
  each result broadcast on its own.
- ``spd-kfac``: each factor's allreduce starts from the hook that computed it (A during
  forward, G during backward), fused with its neighbours by a communication model fitted
  at run time and the factors' measured ready times; factors travel as upper triangles;
  inversions placed largest first on the least loaded rank (n^3 or measured cost), and
  inverted on every rank where a broadcast would cost more than the inversion; each
  owner's results go out in one fused broadcast.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch import nn
from torch.amp import GradScaler

from ...comm.communicator import Communicator
from ...comm.readback import read, write_finite_probe
from ...comm.reusable import reusable_allreduce
from ...errors import OptionError, UnsupportedModelError
from ...kernels.inverse import FAILED, RECOVERED, eigh_psd_, inverse_spd_
from ...kernels.triangle import triangle_numel, unpack_triu_
from ...options import BucketOptions, choices, option, require
from ..base import BucketSolver, StepInfo, SynchronousOptions, register
from . import placement
from .exchange import FactorExchange
from .factors import find_layers
from .fusion import CommModel, measure_comm_model, plan_fusion, probe_sizes
from .inversion import Inverter, result_shapes
from .layers import KFACLayer, factored_damping, precondition_matrix
from .sharing import GradientSharing

Variant = Literal["d-kfac", "mpd-kfac", "spd-kfac"]
VARIANTS = choices(Variant)


@dataclass(frozen=True)
class VariantRule:
    """What a K-FAC variant decides: how the factor work is spread and sent, and the defaults
    of the knobs left at None (:meth:`KFACOptions.resolved`)."""

    #: Each factor is inverted by its owner (or by every member of a group, replicated) and
    #: the result broadcast; False (d-kfac): every rank inverts every factor.
    shares_inversions: bool
    #: Factors travel one message each as soon as they are ready, merged by a fitted
    #: communication model, and inverses are broadcast fused (spd-kfac).
    pipelined: bool
    fusion: str
    placement: str
    replicate: str
    pack_triangles: bool


#: Every variant's rule: the solver reads this table, never the variant's name. Columns:
#: shares_inversions, pipelined, then the defaults of fusion, placement, replicate, pack_triangles.
VARIANT_RULES: dict[str, VariantRule] = {
    "d-kfac": VariantRule(False, False, "none", "round-robin", "never", False),
    "mpd-kfac": VariantRule(True, False, "none", "round-robin", "never", False),
    "spd-kfac": VariantRule(True, True, "dynamic", "balanced", "auto", True),
}
#: Largest message the communication-model probes send (elements); the fit extrapolates.
PROBE_LIMIT = 1 << 22


@dataclass(frozen=True, kw_only=True)
class KFACOptions(BucketOptions, SynchronousOptions):
    """Options of the "kfac" solver (docs/solvers/kfac.md gives the defaults' reasons).

    Knobs left at None take the variant's choice: ``fusion`` ("dynamic" for spd-kfac),
    ``placement`` ("round-robin" for mpd-kfac, "balanced" for spd-kfac), ``replicate``
    ("never" for mpd-kfac, "auto" for spd-kfac), ``pack_triangles`` (True for spd-kfac).
    """

    variant: Variant = option(
        "spd-kfac", "how factor work is spread and communicated: d-kfac, mpd-kfac or spd-kfac (same parameters)"
    )
    method: Literal["eigen", "inverse"] = option(
        "inverse", "inverse (factored Tikhonov damping, batched Cholesky) or eigen (exact damping, eigh)"
    )
    damping: float | Callable[[int], float] = option(
        0.001, "Tikhonov damping, or callable(step) -> damping read at inversion steps; > 0"
    )
    factor_decay: float = option(0.95, "running-average decay of the Kronecker factors, in [0, 1)")
    kl_clip: float | None = option(0.001, "KL clip of the preconditioned step; None disables it")
    factor_update_steps: int | Callable[[int], int] = option(
        10, "steps between factor updates, or callable(step) -> steps (KAISA's); >= 1"
    )
    inv_update_steps: int | Callable[[int], int] = option(
        100, "steps between inversions, or callable(step) -> steps; a multiple of factor_update_steps"
    )
    lr: float | Callable[[int], float] | None = option(
        None,
        "the learning rate the KL clip assumes (float or callable(step)), as KAISA's; None: each param group's "
        "own. The optimizer's lr is left alone",
    )
    skip: tuple | list = option((), "module names, class names or classes left unpreconditioned")
    grad_worker_fraction: float = option(
        1.0,
        "fraction of ranks that precondition each layer (KAISA's): 1 every rank; 1/ranks or 0 the rank that "
        "inverts it, which broadcasts the result; between: groups; ranks x fraction must divide the ranks",
    )
    fusion: Literal["dynamic", "none"] | None = option(
        None, "spd-kfac: dynamic (fitted-model merge of factor messages) or none; None: the variant's"
    )
    fusion_profile_steps: int = option(5, "factor steps measured (after one warm-up) before the fusion plan")
    placement: Literal["balanced", "round-robin"] | None = option(
        None, "who inverts and preconditions what (mpd/spd): balanced or round-robin; None: the variant's"
    )
    placement_cost: Literal["flops", "measured"] = option(
        "flops", "placement cost of inversions and preconditioning: flop counts, or seconds timed at construction"
    )
    replicate: Literal["auto", "never"] | None = option(
        None,
        "auto: a group inverts a factor on every member where that beats its broadcast (timed); None: the variant's",
    )
    pack_triangles: bool | None = option(
        None, "factors travel and are averaged as upper triangles; None: the variant's (spd-kfac: True)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not callable(self.damping):
            require(math.isfinite(self.damping) and self.damping > 0, f"damping must be > 0, got {self.damping}")
        require(0.0 <= self.factor_decay < 1.0, f"factor_decay must be in [0, 1), got {self.factor_decay}")
        require(self.kl_clip is None or self.kl_clip > 0, f"kl_clip must be > 0 or None, got {self.kl_clip}")
        factor, inverse = self.factor_update_steps, self.inv_update_steps
        if not callable(factor):
            require(factor >= 1, f"factor_update_steps must be >= 1, got {factor}")
        if not callable(inverse):
            require(inverse >= 1, f"inv_update_steps must be >= 1, got {inverse}")
        if not callable(factor) and not callable(inverse):
            require(
                inverse % factor == 0,
                f"inv_update_steps must be a positive multiple of factor_update_steps ({factor}), got {inverse}",
            )
        if self.lr is not None and not callable(self.lr):
            require(self.lr >= 0, f"lr must be >= 0, got {self.lr}")
        for entry in self.skip:
            require(isinstance(entry, (str, type)), f"skip entries must be module names or classes, got {entry!r}")
        require(
            0.0 <= self.grad_worker_fraction <= 1.0,
            f"grad_worker_fraction must be in [0, 1], got {self.grad_worker_fraction}",
        )
        require(self.fusion_profile_steps >= 1, f"fusion_profile_steps must be >= 1, got {self.fusion_profile_steps}")
        if not self.rule.pipelined:
            require(self.fusion is None, f"fusion applies to variant 'spd-kfac' only, not {self.variant!r}")
        if not self.rule.shares_inversions:
            for knob in ("placement", "replicate"):
                require(
                    getattr(self, knob) is None,
                    f"{knob} applies to mpd-kfac and spd-kfac: d-kfac inverts everything everywhere",
                )

    @property
    def rule(self) -> VariantRule:
        """The variant's rule (:data:`VARIANT_RULES`)."""
        return VARIANT_RULES[self.variant]

    def resolved(self, knob: str) -> Any:
        """A knob's value, the variant's default when left at None."""
        value = getattr(self, knob)
        return getattr(self.rule, knob) if value is None else value


def _every(value: int | Callable[[int], int], step: int, name: str) -> bool:
    """Whether ``step`` is one of every ``value`` (or ``value(step)``) steps."""
    interval = value(step) if callable(value) else value
    if not isinstance(interval, int) or interval < 1:
        raise OptionError(f"the {name} schedule gave {interval!r} at step {step}: an int >= 1")
    return step % interval == 0


def _schedule(value: float | Callable[[int], float], step: int, name: str) -> float:
    result = float(value(step)) if callable(value) else float(value)
    if not math.isfinite(result) or (result <= 0 if name == "damping" else result < 0):
        raise OptionError(f"the {name} schedule gave {result} at step {step}")
    return result


PHASES = (
    "factor_compute",
    "factor_comm",
    "inversion",
    "inverse_wait",
    "inverse_transfer",
    "precondition",
    "gradient_wait",
    "gradient_transfer",
)


def gradient_workers(fraction: float, ranks: int) -> int:
    """Ranks that precondition each layer: ``max(1, round(ranks x fraction))``, which must divide ``ranks``."""
    workers = max(1, round(ranks * fraction))
    if ranks % workers:
        divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
        raise OptionError(
            f"grad_worker_fraction {fraction:g} at {ranks} ranks gives {workers} gradient workers per layer, "
            f"which does not divide the ranks into equal groups; use a fraction giving one of {divisors} "
            f"(e.g. {', '.join(f'{d}/{ranks}' for d in divisors)})"
        )
    return workers


@register
class KFACSolver(BucketSolver[KFACOptions]):
    """Distributed K-FAC (Martens and Grosse; KFC for convolutions) with the D-, MPD- and SPD-KFAC schemes."""

    name = "kfac"
    Options = KFACOptions

    def setup(self) -> None:
        o = self.options
        specs = find_layers(self.model, o.skip)
        if not specs:
            raise OptionError("kfac: the model has no Linear or Conv2d layer left to precondition")
        devices = {s.module.weight.device for s in specs}
        if len(devices) > 1:
            raise UnsupportedModelError(
                f"kfac: preconditioned layers are on several devices: {sorted(map(str, devices))}"
            )
        dtype = torch.float32
        for s in specs:
            if s.module.weight.dtype not in (torch.float16, torch.bfloat16):
                dtype = torch.promote_types(dtype, s.module.weight.dtype)
        self.device = devices.pop()
        ranks, rank = self.comm.size, self.comm.rank
        #: Gradient-worker groups (see placement): this rank's group and row.
        self.groups = placement.worker_groups(ranks, gradient_workers(o.grad_worker_fraction, ranks))
        self.group = rank % len(self.groups)
        # The preconditioner rewrites the gradients in place: node-shared sums are copied out.
        self.grads = self._gradient_buckets(
            o.bucket_mb,
            average=True,
            shared_result=False,
            extra_reads=2 * len(specs),  # each batch factor's finite probe, read with the step's tally
        )
        # Factor traffic has its own communicator: its collectives, started from forward and
        # backward hooks, never have to be ordered against the gradient buckets'.
        self.factor_comm = self.comm.dup()
        self.group_comm = self._split(self.group)
        self.row_comm = self._split(rank // len(self.groups))
        self.factor_comm.barrier("K-FAC clock")
        epoch = time.perf_counter()  # an instant every rank shares, to split waiting from transfer
        self.packed = bool(o.resolved("pack_triangles"))
        self.layers = [KFACLayer(s, o.method, dtype, self.device, self.packed) for s in specs]
        self.factors = [f for layer in self.layers for f in (layer.a, layer.g)]
        # By index, not the group itself: optimizer.load_state_dict (a resume, join()'s hand-over) makes new groups.
        self._group_of = {id(p): i for i, group in enumerate(self.optimizer.param_groups) for p in group["params"]}
        self.comm_models: dict[str, CommModel] = {}
        self.inverting_ranks = self._inverting_ranks()
        self._place()
        #: The layers this rank preconditions (its group's), and their factors.
        self.own_layers = [i for i, g in enumerate(self.layer_group) if g == self.group]
        members = [f for i in self.own_layers for f in (2 * i, 2 * i + 1)]
        group_ranks = self.groups[self.group]
        self.inverter = Inverter(
            self.group_comm,
            self.factors,
            members,
            [group_ranks.index(r) if r in group_ranks else placement.EVERY_RANK for r in self.owners],
            method=o.method,
            packed=self.inverse_packed,
            fuse_broadcasts=o.rule.pipelined,
            epoch=epoch,
        )
        self.sharing = GradientSharing(
            self.row_comm,
            [layer.result.shape for layer in self.layers],
            self.layer_group,
            dtype=dtype,
            device=self.device,
            epoch=epoch,
        )
        for layer, result in zip(self.layers, self.sharing.results):
            layer.result = result
        self._statuses = reusable_allreduce(self.factor_comm, self.inverter.statuses, "max")
        self.exchange = self._exchange(self._unfused_groups(), eager=o.rule.pipelined)
        self._fusion_pending = o.resolved("fusion") == "dynamic" and self.comm.size > 1
        self._ready_at = torch.zeros(len(self.factors), dtype=torch.float64)
        self._ready_sum = torch.zeros(len(self.factors) + 1, dtype=torch.float64)  # + profiled steps
        self._stream_start: dict[str, float] = {}
        self._captures = 0
        self._accumulated = [0] * len(self.factors)  # samples of this step's micro-batches summed into each factor
        self._hooks = [
            # Run eagerly under torch.compile (a graph break per layer): the capture talks to MPI.
            layer.spec.module.register_forward_hook(torch.compiler.disable(partial(self._on_forward, i)))
            for i, layer in enumerate(self.layers)
        ]
        self.steps = 0
        self._damping_used = 0.0
        self._capturing = True
        self._invert_next = False
        self.timings = dict.fromkeys(PHASES, 0.0)

    # ------------------------------------------------------------ structure
    def _split(self, color: int) -> Communicator:
        sub = self.comm.split(color)
        assert sub is not None  # every rank passes a color
        return sub

    def _unfused_groups(self) -> list[list[int]]:
        """Before (or without) fusion: one message for all (d/mpd) or one per factor (spd)."""
        forward = [2 * i for i in range(len(self.layers))]
        backward = [2 * i + 1 for i in reversed(range(len(self.layers)))]
        if self.options.rule.pipelined:
            return [[f] for f in forward + backward]
        return [forward + backward]

    def _exchange(self, groups: list[list[int]], eager: bool) -> FactorExchange:
        return FactorExchange(
            self.factor_comm,
            [f.dim for f in self.factors],
            [f.name for f in self.factors],
            groups,
            packed=self.packed,
            eager=eager,
            dtype=self.factors[0].running.dtype,
            device=self.device,
        )

    def _place(self) -> None:
        """Each layer's group (``layer_group``), each factor's owner (``owners``: a rank, or
        ``EVERY_RANK``: every member of its layer's group), the costs balanced
        (``inversion_costs`` per factor, ``precondition_costs`` per layer, one unit), and
        whether each inverse is broadcast as its upper triangle (``inverse_packed``).

        The same on every rank: whatever is measured is agreed on (slowest rank) first.
        """
        o = self.options
        dims = [f.dim for f in self.factors]
        shapes = [(layer.spec.g_dim, layer.spec.a_dim) for layer in self.layers]
        self.inversion_costs = [placement.flop_cost(n, o.method) for n in dims]
        self.precondition_costs = [placement.precondition_flop_cost(g, a, o.method) for g, a in shapes]
        self.inverse_packed = [False] * len(dims)
        replicated = [True] * len(dims)
        broadcasts = o.rule.shares_inversions and self.group_comm.size > 1
        seconds: dict[int, float] = {}
        if broadcasts:
            packable = self.packed and o.method == "inverse"
            if o.resolved("replicate") == "auto" or packable:
                largest = max(sum(s.numel() for s in result_shapes(n, o.method, False)) for n in dims)
                sizes = probe_sizes(min(largest, PROBE_LIMIT))
                self.comm_models["bcast"] = measure_comm_model(self.group_comm, "bcast", sizes)
            pays = {n: packable and self._packing_pays(n) for n in sorted(set(dims))}
            self.inverse_packed = [pays[n] for n in dims]
            wire = [sum(s.numel() for s in result_shapes(n, o.method, p)) for n, p in zip(dims, self.inverse_packed)]
            replicated = [False] * len(dims)
            if o.resolved("replicate") == "auto":
                # Each group timed its own broadcasts; the slowest group's figures decide everywhere,
                # so every rank times the same inversions below (each timing is collective over all ranks).
                local = {n: self.comm_models["bcast"].seconds(w) for n, w in zip(dims, wire)}
                order = sorted(local)
                agreed = self.factor_comm.allreduce_(
                    torch.tensor([local[n] for n in order], dtype=torch.float64), op="max", what="K-FAC broadcast model"
                )
                broadcast = dict(zip(order, agreed.tolist()))
                # Smallest first until an inversion costs more than its broadcast: beyond, inversions
                # grow as n^3 and broadcasts as n^2.
                for n in sorted(broadcast):
                    seconds[n] = self._time_inversion(n)
                    if seconds[n] > broadcast[n]:
                        break
                replicated = [n in seconds and seconds[n] <= broadcast[n] for n in dims]
        elif o.rule.shares_inversions:
            replicated = [False] * len(dims)  # a group of one: its member inverts everything it preconditions
        if o.placement_cost == "measured":
            for n in sorted(set(dims) - set(seconds)):
                seconds[n] = self._time_inversion(n)
            self.inversion_costs = [seconds[n] for n in dims]
            timed = {shape: self._time_precondition(*shape) for shape in sorted(set(shapes))}
            self.precondition_costs = [timed[shape] for shape in shapes]
        self.layer_group, self.owners = placement.assign(
            self.inversion_costs,
            self.precondition_costs,
            self.groups,
            inverters=self.inverting_ranks,
            replicated=replicated,
            balance=not o.rule.shares_inversions or o.resolved("placement") == "balanced",
        )

    def _packing_pays(self, n: int) -> bool:
        """Whether broadcasting an n x n inverse as its triangle saves more wire time (by the
        fitted broadcast model) than unpacking it costs a receiver (measured here, the
        slowest rank's). On a CPU the unpack's transposed writes often cost more."""
        saved = self.comm_models["bcast"].beta * (n * n - triangle_numel(n))
        packed = torch.randn(triangle_numel(n), dtype=self.factors[0].running.dtype).to(self.device)
        out = torch.empty(n, n, dtype=packed.dtype, device=self.device)
        seconds = 0.0
        for _ in range(2):  # the second call: the first may pay for compilation
            start = time.perf_counter()
            unpack_triu_(packed, out)
            seconds = time.perf_counter() - start
        return saved > self._slowest(seconds, "unpack timing")

    def _slowest(self, seconds: float, what: str) -> float:
        timing = torch.tensor([seconds], dtype=torch.float64)
        return float(self.factor_comm.allreduce_(timing, op="max", what=what))

    def _inverting_ranks(self) -> list[int]:
        """The ranks that may own inversions: every rank, except that for a balanced placement a
        node running more ranks than it has cores gives them to as many of its ranks as it
        has cores (more would only time-share those cores, and thrash their caches)."""
        o = self.options
        if not o.rule.shares_inversions or o.resolved("placement") != "balanced" or self.comm.size == 1:
            return list(range(self.comm.size))
        seats = self.comm.allgather_object(self.comm.local_rank < self.comm.cores)
        return [rank for rank, seated in enumerate(seats) if seated]

    def _time_inversion(self, n: int) -> float:
        """Seconds to decompose one n x n factor here, the median of a few after a warm-up call;
        the slowest rank's, so all ranks agree."""
        generator = torch.Generator().manual_seed(n)
        x = torch.randn(n, 2 * n, generator=generator, dtype=self.factors[0].running.dtype)
        source = (x @ x.T / (2 * n)).unsqueeze(0).to(self.device)
        stack = source.clone()
        values = torch.empty(1, n, dtype=stack.dtype, device=self.device)
        times = []
        for _ in range(1 + (3 if n < 512 else 1)):
            stack.copy_(source)
            start = time.perf_counter()
            if self.options.method == "inverse":
                inverse_spd_(stack, [1e-3])
            else:
                eigh_psd_(stack, values)
            times.append(time.perf_counter() - start)
        return self._slowest(statistics.median(times[1:]), "inversion timing")  # the first pays for initialisation

    def _time_precondition(self, g: int, a: int) -> float:
        """Seconds to precondition one ``g x a`` gradient here, the median of a few after a warm-up;
        the slowest rank's."""
        dtype = self.factors[0].running.dtype
        generator = torch.Generator().manual_seed(g * 100003 + a)
        g_dec, a_dec = torch.randn(g, g, generator=generator, dtype=dtype), torch.randn(a, a, generator=generator)
        v = torch.randn(g, a, generator=generator, dtype=dtype)
        tensors = [t.to(self.device, dtype) for t in (g_dec, a_dec, v, torch.empty(g, a), torch.empty(g, a))]
        scale = torch.ones(g, a, dtype=dtype, device=self.device) if self.options.method == "eigen" else None
        times = []
        for _ in range(1 + (3 if g * a < 1 << 18 else 1)):
            start = time.perf_counter()
            precondition_matrix(self.options.method, tensors[0], tensors[1], scale, *tensors[2:])
            times.append(time.perf_counter() - start)
        return self._slowest(statistics.median(times[1:]), "preconditioning timing")

    def placement_loads(self) -> list[float]:
        """Each rank's predicted cost under the placement: inversions plus preconditioning (flops
        or, with ``placement_cost="measured"``, seconds).

        ``max_over_mean`` of the loads of ``inverting_ranks`` is the placement's balance."""
        return placement.loads(
            self.inversion_costs,
            self.owners,
            self.comm.size,
            precondition=self.precondition_costs,
            layer_group=self.layer_group,
            groups=self.groups,
        )

    # ---------------------------------------------------------------- hooks
    def _on_forward(self, index: int, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if not (self._capturing and self._training_forward(module)):
            return
        x = inputs[0]
        self._capture(2 * index, "forward", lambda out: self.layers[index].computer.compute_a(x, out), x.shape[0])
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(partial(self._on_grad_output, index))

    def _on_grad_output(self, index: int, grad: torch.Tensor) -> None:
        compute = partial(self.layers[index].computer.compute_g, grad)
        self._capture(2 * index + 1, "backward", compute, grad.shape[0])

    def _capture(self, f: int, stream: str, compute: Callable[[torch.Tensor], None], batch: int) -> None:
        """Factor ``f`` of a micro-batch of ``batch`` samples: computed and sent, or (under ``no_sync()``,
        gradient accumulation) added to the step's sum, which the step's last micro-batch sends."""
        start = time.perf_counter()
        compute(self.exchange.target(f))
        if self.grads.accumulating or self._accumulated[f]:
            self._accumulate(f, batch)
        else:
            self.exchange.ready(f)
        now = time.perf_counter()
        self.timings["factor_compute"] += now - start
        if self._fusion_pending:
            self._ready_at[f] = now - self._stream_start.setdefault(stream, now)

    def _accumulate(self, f: int, batch: int) -> None:
        """Gradient accumulation: one process's factor on the micro-batches together.

        A micro-batch's A is the mean over its n samples of a a^T; its G, from a loss
        divided by the number of micro-batches (as the documented loop does), is n/S times
        the sum of e e^T of the per-sample output gradients e, which are the concatenated
        batch's. So the step's A is sum(n A) / N and its G is N sum(G / n) over its N samples.
        """
        is_a = f % 2 == 0
        self.exchange.accumulate(f, float(batch) if is_a else 1.0 / batch)
        total = self._accumulated[f] = self._accumulated[f] + batch
        if not self.grads.accumulating:  # the step's last micro-batch
            self._send_accumulated(f, total)

    def _send_accumulated(self, f: int, total: int) -> None:
        self.exchange.ready(f, 1.0 / total if f % 2 == 0 else float(total))
        self._accumulated[f] = 0

    # ----------------------------------------------------------------- step

    def _synchronize(self, scaler: GradScaler | None) -> None:
        self._exchange_factors()
        super()._synchronize(scaler)

    def _exchange_factors(self) -> None:
        """Complete the step's factor messages, first in the step whether it begins at
        ``synchronize()`` or at ``step()``: node-shared sums complete in one order on every
        rank, and a rank shadowing the others' steps under ``join()`` calls ``step()`` alone."""
        for f, total in enumerate(self._accumulated):
            if total:  # every micro-batch of this step ran inside no_sync()
                self._send_accumulated(f, total)
        if not self._capturing or self.exchange.finished:
            return
        if self.grads.backward_ran and not any(self.exchange.captured):
            raise RuntimeError(
                "mpisolve kfac: backward ran but no layer's Kronecker factors were captured: the layer hooks "
                "did not run. A torch.compile'd module called before the solver was made does not see hooks "
                "added later: make the solver first (or give it the compiled module before its first call)"
            )
        start = time.perf_counter()
        self.exchange.finish()
        self.timings["factor_comm"] += time.perf_counter() - start

    def _step(self, batch_size: int | None, scaler: GradScaler | None) -> StepInfo:
        o = self.options
        step = self.steps
        self._exchange_factors()
        if self._capturing:
            middle = time.perf_counter()
            self._update_factors(scaler)
            self.timings["factor_compute"] += time.perf_counter() - middle
            if self._fusion_pending:
                self._profile()
        inverting = _every(o.inv_update_steps, step, "inv_update_steps") or self._invert_next
        self._invert_next = False
        if inverting:
            self._start_inverses(_schedule(o.damping, step, "damping"))

        def precondition() -> None:
            self._precondition(inverting, None if o.lr is None else _schedule(o.lr, step, "lr"))

        # The averaged gradients are the same everywhere: every rank decides alike, unasked.
        def finish_inverses(applied: bool) -> None:
            self._finish_inverses(refresh=not applied)

        info = self._bucket_step(
            self.grads,
            batch_size,
            scaler,
            "averaged gradients",
            before_update=precondition,
            after_update=finish_inverses if inverting else None,
        )
        self.steps += 1
        if self._capturing:
            self._warn_nonfinite_factors(scaler)
            self.exchange.rearm()
        self._capturing = _every(o.factor_update_steps, self.steps, "factor_update_steps")
        return info

    def _drain(self) -> None:
        """Complete a round some rank left in flight (close): the factors' messages, the gradients',
        the inverses' (a step that raised, e.g. on non-finite gradients, left them travelling)."""
        if self._capturing and not self.exchange.finished:
            self.exchange.finish()
        self.grads.finish()
        if self.inverter.in_flight:
            self.inverter.finish()

    def _update_factors(self, scaler: GradScaler | None) -> None:
        """Fold this step's summed batch factors into the running averages.

        With a GradScaler, G came from the scaled loss: it is divided by the scale squared,
        and a non-finite G (a step the scaler skips) is left out without a warning.
        """
        scaled = scaler is not None and scaler.is_enabled()
        unscale = 1.0 / scaler.get_scale() ** 2 if scaler is not None and scaled else 1.0
        probes = self.grads.extra_reads  # read by the host with the step's tally (see _warn_nonfinite_factors)
        probes.zero_()
        for f, factor in enumerate(self.factors):
            batch, count = self.exchange.result(f)
            if count == 0:
                continue
            if scaled and f % 2 == 1:
                batch.mul_(unscale)
            write_finite_probe([batch], probes[f])
            factor.update(batch, count, self.options.factor_decay, torch.isfinite(probes[f]))

    def _warn_nonfinite_factors(self, scaler: GradScaler | None) -> None:
        """After a factor step's read: the batch factors that were not finite were left out on
        the device; count them as not folded in, and name them (a G factor under a GradScaler
        is the scaler's normal skip, not worth a warning)."""
        scaled = scaler is not None and scaler.is_enabled()
        probes = self.grads.extra_values()
        skipped = []
        for f, factor in enumerate(self.factors):
            if not math.isfinite(probes[f]):
                factor.updates -= 1
                if not (scaled and f % 2 == 1):
                    skipped.append(factor.name)
        if skipped:
            self._warn(f"non-finite batch factors (their running averages are left as they were): {', '.join(skipped)}")

    def _start_inverses(self, damping: float) -> None:
        """Invert this rank's share and start the broadcasts; preconditioning collects the results."""
        shifts = [0.0] * len(self.factors)
        if self.options.method == "inverse":  # every factor's mean eigenvalue, in one read
            means = read(torch.stack([f.mean_eigenvalue() for f in self.factors]))
            for i in range(len(self.layers)):
                shifts[2 * i], shifts[2 * i + 1] = factored_damping(means[2 * i], means[2 * i + 1], damping)
        self._damping_used = damping
        self.inverter.start(shifts)

    def _finish_inverses(self, refresh: bool) -> None:
        """Complete the round (what preconditioning did not need yet; ``refresh``: the eigen
        scales too, which preconditioning refreshes as it goes), and warn, on rank 0, of the
        factors any group could not decompose."""
        self.inverter.finish()
        if refresh:
            for i in self.own_layers:
                self.layers[i].refresh_scale(self._damping_used)
        for phase in ("inversion", "inverse_wait", "inverse_transfer"):
            self.timings[phase] += self.inverter.seconds[phase]
        self._statuses.start()
        self._statuses.wait("K-FAC inversion status")
        statuses = self.inverter.statuses.tolist()
        failed = [f.name for f, s in zip(self.factors, statuses) if s == FAILED]
        recovered = [f.name for f, s in zip(self.factors, statuses) if s == RECOVERED]
        if recovered:
            self._warn(f"factors inverted through float64 eigh after the fast path failed: {', '.join(recovered)}")
        if failed:
            self._warn(
                "factors that could not be decomposed (not finite, or singular): "
                f"{', '.join(failed)}; each keeps its previous decomposition (the identity before the first)"
            )

    def _warn(self, message: str) -> None:
        if self.comm.rank == 0:
            warnings.warn(f"mpisolve kfac, step {self.steps}: {message}", RuntimeWarning, stacklevel=3)

    def _precondition(self, inverting: bool, lr: float | None) -> None:
        """Precondition this rank's layers, each as soon as its decompositions are here (while
        the others' broadcasts travel), send each result to the row, and write every layer's.
        ``lr``: the KL clip's learning rate (None: each layer's param group's)."""
        o = self.options
        self.sharing.post()
        pending = list(self.own_layers)
        seconds = 0.0
        while pending:
            ready = next((i for i in pending if self._decomposed(i)), None)
            if ready is None:  # nothing here to work on: wait for the next layer's broadcast
                self.inverter.wait(next(f for f in (2 * pending[0], 2 * pending[0] + 1) if not self.inverter.ready(f)))
                continue
            pending.remove(ready)
            layer = self.layers[ready]
            start = time.perf_counter()
            usable = layer.ready and layer.spec.module.weight.grad is not None
            if usable:
                if inverting:
                    layer.refresh_scale(self._damping_used)
                layer.precondition(layer.gradient())
            else:  # zeros, which the flag's blend leaves out exactly (stale values might not be finite)
                layer.result.zero_()
            seconds += time.perf_counter() - start
            self.sharing.send(ready, usable)
            if inverting:
                self.inverter.progress()
        flags = self.sharing.finish()
        start = time.perf_counter()
        # On the device throughout: which layers were preconditioned is known there (a flag per
        # layer), and so are the KL clip's sum and scale; the host reads none of them.
        active = [(layer, flag) for layer, flag in zip(self.layers, flags) if layer.spec.module.weight.grad is not None]
        scale = None
        if o.kl_clip is not None and active:
            groups = self.optimizer.param_groups
            terms = []
            for layer, flag in active:
                rate = float(groups[self._group_of[id(layer.spec.module.weight)]]["lr"]) if lr is None else lr
                dot = torch.dot(layer.result.reshape(-1), layer.gradient().reshape(-1))
                terms.append(dot.mul_(flag).mul_(rate * rate))
            quadratic = torch.stack(terms).sum().abs_()
            # min(1, sqrt(kl_clip / |q|)), and 1 where nothing was preconditioned (q = 0)
            scale = torch.where(quadratic > 0, quadratic.reciprocal_().mul_(o.kl_clip).sqrt_().clamp_(max=1.0), 1.0)
        for layer, flag in active:
            layer.write(flag, scale)
        self.timings["precondition"] += seconds + time.perf_counter() - start
        for phase in ("gradient_wait", "gradient_transfer"):
            self.timings[phase] += self.sharing.seconds[phase]

    def _decomposed(self, layer: int) -> bool:
        return self.inverter.ready(2 * layer) and self.inverter.ready(2 * layer + 1)

    def _profile(self) -> None:
        """Fusion: after a warm-up step, accumulate ready times; then plan and rebuild the messages."""
        self._captures += 1
        self._stream_start.clear()
        if self._captures == 1:
            return  # the first step pays for allocations: not representative
        self._ready_sum[:-1] += self._ready_at
        self._ready_sum[-1] += 1
        if self._captures <= self.options.fusion_profile_steps:
            return
        self._fusion_pending = False
        totals = self.factor_comm.allreduce_(self._ready_sum.clone(), what="K-FAC fusion profile")
        ready = (totals[:-1] / totals[-1]).tolist()
        sizes = [self.exchange.wire_numel(f) for f in range(len(self.factors))]
        largest = min(sum(sizes), PROBE_LIMIT)
        self.comm_models["allreduce"] = model = measure_comm_model(self.factor_comm, "allreduce", probe_sizes(largest))
        groups = []
        for stream in (range(0, len(self.factors), 2), range(1, len(self.factors), 2)):
            order = sorted(stream, key=lambda f: (ready[f], f))
            plan = plan_fusion([sizes[f] for f in order], [ready[f] for f in order], model)
            groups += [[order[i] for i in group] for group in plan]
        self.exchange.close()
        self.exchange = self._exchange(groups, eager=True)

    # ---------------------------------------------------------------- state
    def reset_timings(self) -> None:
        self.timings = dict.fromkeys(PHASES, 0.0)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(
            steps=self.steps,
            damping_used=self._damping_used,
            factors={f.name: f.state_dict() for f in self.factors},
            decomposed=sorted(self.layers[i].spec.name for i in self.own_layers),
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        names = [f.name for f in self.factors]
        if sorted(state["factors"]) != sorted(names):
            raise ValueError(f"K-FAC state is for factors {sorted(state['factors'])}, this model has {sorted(names)}")
        for factor in self.factors:
            factor.load_state_dict(state["factors"][factor.name])
        self.steps = int(state["steps"])
        self._damping_used = float(state["damping_used"])
        for layer in self.layers:
            layer.refresh_scale(self._damping_used)
        self._capturing = _every(self.options.factor_update_steps, self.steps, "factor_update_steps")
        # A rank's state holds the decompositions of the layers it preconditioned; loaded where
        # other layers are this rank's (another world size or fraction), invert at the next step.
        own = {self.layers[i].spec.name for i in self.own_layers}
        missing = torch.tensor([0 if own <= set(state.get("decomposed", ())) else 1], dtype=torch.int32)
        self._invert_next = bool(self.factor_comm.allreduce_(missing, op="max", what="K-FAC state check"))
        self.exchange.rearm()

    def _remove_hooks(self) -> None:
        super()._remove_hooks()
        for hook in self._hooks:
            hook.remove()

    def _round_in_flight(self) -> bool:
        return self.grads.in_flight or self.exchange.in_flight or self.inverter.in_flight

    def _free(self) -> None:
        super()._free()
        self.exchange.close()
        self.inverter.close()
        self.sharing.close()
        self._statuses.free()
