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
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch import nn
from torch.amp import GradScaler

from ...comm.buckets import GradientBuckets
from ...kernels.inverse import FAILED, RECOVERED, eigh_psd_, inverse_spd_
from ...kernels.triangle import triangle_numel, unpack_triu_
from ...options import OptionError, require
from ..base import Solver, StepInfo, SynchronousOptions, collective_round, register
from . import placement
from .exchange import FactorExchange
from .factors import find_layers
from .fusion import CommModel, measure_comm_model, plan_fusion, probe_sizes
from .inversion import Inverter, result_shapes
from .layers import KFACLayer, factored_damping

VARIANTS = ("d-kfac", "mpd-kfac", "spd-kfac")
#: Largest message the communication-model probes send (elements); the fit extrapolates.
PROBE_LIMIT = 1 << 22


@dataclass(frozen=True, kw_only=True)
class KFACOptions(SynchronousOptions):
    """Options of the "kfac" solver (see the README's K-FAC section for the defaults' reasons).

    Knobs left at None take the variant's choice: ``fusion`` ("dynamic" for spd-kfac),
    ``placement`` ("round-robin" for mpd-kfac, "balanced" for spd-kfac), ``replicate``
    ("never" for mpd-kfac, "auto" for spd-kfac), ``pack_triangles`` (True for spd-kfac).
    """

    variant: Literal["d-kfac", "mpd-kfac", "spd-kfac"] = "spd-kfac"
    method: Literal["eigen", "inverse"] = "inverse"
    damping: float | Callable[[int], float] = 0.001
    factor_decay: float = 0.95
    kl_clip: float | None = 0.001
    factor_update_steps: int = 10
    inv_update_steps: int = 100
    lr: float | Callable[[int], float] | None = None
    skip: tuple | list = ()
    bucket_mb: float = 25.0
    fusion: Literal["dynamic", "none"] | None = None
    fusion_profile_steps: int = 5
    placement: Literal["balanced", "round-robin"] | None = None
    placement_cost: Literal["flops", "measured"] = "flops"
    replicate: Literal["auto", "never"] | None = None
    pack_triangles: bool | None = None

    def __post_init__(self) -> None:
        if not callable(self.damping):
            require(math.isfinite(self.damping) and self.damping > 0, f"damping must be > 0, got {self.damping}")
        require(0.0 <= self.factor_decay < 1.0, f"factor_decay must be in [0, 1), got {self.factor_decay}")
        require(self.kl_clip is None or self.kl_clip > 0, f"kl_clip must be > 0 or None, got {self.kl_clip}")
        require(self.factor_update_steps >= 1, f"factor_update_steps must be >= 1, got {self.factor_update_steps}")
        require(
            self.inv_update_steps >= 1 and self.inv_update_steps % self.factor_update_steps == 0,
            f"inv_update_steps must be a positive multiple of factor_update_steps ({self.factor_update_steps}), "
            f"got {self.inv_update_steps}",
        )
        if self.lr is not None and not callable(self.lr):
            require(self.lr >= 0, f"lr must be >= 0, got {self.lr}")
        for entry in self.skip:
            require(isinstance(entry, (str, type)), f"skip entries must be module names or classes, got {entry!r}")
        require(self.bucket_mb > 0, f"bucket_mb must be > 0, got {self.bucket_mb}")
        require(self.fusion_profile_steps >= 1, f"fusion_profile_steps must be >= 1, got {self.fusion_profile_steps}")
        if self.variant != "spd-kfac":
            require(self.fusion is None, f"fusion applies to variant 'spd-kfac' only, not {self.variant!r}")
        if self.variant == "d-kfac":
            for knob in ("placement", "replicate"):
                require(
                    getattr(self, knob) is None,
                    f"{knob} applies to mpd-kfac and spd-kfac: d-kfac inverts everything everywhere",
                )

    def resolved(self, knob: str) -> Any:
        """A knob's value, the variant's default when left at None."""
        value = getattr(self, knob)
        if value is not None:
            return value
        spd = self.variant == "spd-kfac"
        return {
            "fusion": "dynamic" if spd else "none",
            "placement": "balanced" if spd else "round-robin",
            "replicate": "auto" if spd else "never",
            "pack_triangles": spd,
        }[knob]


def _schedule(value: float | Callable[[int], float], step: int, name: str) -> float:
    result = float(value(step)) if callable(value) else float(value)
    if not math.isfinite(result) or (result <= 0 if name == "damping" else result < 0):
        raise OptionError(f"the {name} schedule gave {result} at step {step}")
    return result


PHASES = ("factor_compute", "factor_comm", "inversion", "inverse_comm", "precondition")


@register
class KFACSolver(Solver):
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
            raise ValueError(f"kfac: preconditioned layers are on several devices: {sorted(map(str, devices))}")
        dtype = torch.float32
        for s in specs:
            if s.module.weight.dtype not in (torch.float16, torch.bfloat16):
                dtype = torch.promote_types(dtype, s.module.weight.dtype)
        self.device = devices.pop()
        # The preconditioner rewrites the gradients in place: node-shared sums are copied out.
        self.grads = GradientBuckets(
            self.params,
            self.comm,
            bucket_bytes=int(o.bucket_mb * 1e6),
            samples=self.samples_seen,
            average=True,
            shared_result=False,
        )
        # Factor traffic has its own communicator: its collectives, started from forward and
        # backward hooks, never have to be ordered against the gradient buckets'.
        self.factor_comm = self.comm.split(0)
        self.packed = bool(o.resolved("pack_triangles"))
        self.layers = [KFACLayer(s, o.method, dtype, self.device, self.packed) for s in specs]
        self.factors = [f for layer in self.layers for f in (layer.a, layer.g)]
        self._group_lr = {id(p): group for group in self.optimizer.param_groups for p in group["params"]}
        self.comm_models: dict[str, CommModel] = {}
        self.inverting_ranks = self._inverting_ranks()
        self.owners, self.inversion_costs, self.inverse_packed = self._place()
        self.inverter = Inverter(
            self.factor_comm,
            self.factors,
            self.owners,
            method=o.method,
            packed=self.inverse_packed,
            fuse_broadcasts=o.variant == "spd-kfac",
        )
        self.exchange = self._exchange(self._unfused_groups(), eager=o.variant == "spd-kfac")
        self._fusion_pending = o.resolved("fusion") == "dynamic" and self.comm.size > 1
        self._ready_at = torch.zeros(len(self.factors), dtype=torch.float64)
        self._ready_sum = torch.zeros(len(self.factors) + 1, dtype=torch.float64)  # + profiled steps
        self._stream_start: dict[str, float] = {}
        self._captures = 0
        self._hooks = [
            # Run eagerly under torch.compile (a graph break per layer): the capture talks to MPI.
            layer.spec.module.register_forward_hook(torch.compiler.disable(partial(self._on_forward, i)))
            for i, layer in enumerate(self.layers)
        ]
        self.steps = 0
        self._damping_used = 0.0
        self._capturing = True
        self.timings = dict.fromkeys(PHASES, 0.0)

    # ------------------------------------------------------------ structure
    def _unfused_groups(self) -> list[list[int]]:
        """Before (or without) fusion: one message for all (d/mpd) or one per factor (spd)."""
        forward = [2 * i for i in range(len(self.layers))]
        backward = [2 * i + 1 for i in reversed(range(len(self.layers)))]
        if self.options.variant == "spd-kfac":
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

    def _place(self) -> tuple[list[int], list[float], list[bool]]:
        """Owner of each factor's inversion (``EVERY_RANK``: all ranks), the costs it balanced,
        and whether each inverse is broadcast as its upper triangle.

        The same on every rank: whatever is measured is agreed on (slowest rank) first.
        """
        o, ranks = self.options, self.comm.size
        dims = [f.dim for f in self.factors]
        flops = [placement.flop_cost(n) for n in dims]
        if o.variant == "d-kfac" or ranks == 1:
            return [placement.EVERY_RANK] * len(dims), flops, [False] * len(dims)
        packable = self.packed and o.method == "inverse"
        if o.resolved("replicate") == "auto" or packable:
            largest = max(sum(s.numel() for s in result_shapes(n, o.method, False)) for n in dims)
            sizes = probe_sizes(min(largest, PROBE_LIMIT))
            self.comm_models["bcast"] = measure_comm_model(self.factor_comm, "bcast", sizes)
        pays = {n: packable and self._packing_pays(n) for n in sorted(set(dims))}
        pack = [pays[n] for n in dims]
        wire = [sum(s.numel() for s in result_shapes(n, o.method, p)) for n, p in zip(dims, pack)]
        seconds: dict[int, float] = {}
        replicated = [False] * len(dims)
        if o.resolved("replicate") == "auto":
            broadcast = {n: self.comm_models["bcast"].seconds(w) for n, w in zip(dims, wire)}
            # Smallest first until an inversion costs more than its broadcast: beyond, inversions
            # grow as n^3 and broadcasts as n^2.
            for n in sorted(broadcast):
                seconds[n] = self._time_inversion(n)
                if seconds[n] > broadcast[n]:
                    break
            replicated = [n in seconds and seconds[n] <= broadcast[n] for n in dims]
        costs = flops
        if o.placement_cost == "measured":
            for n in sorted(set(dims) - set(seconds)):
                seconds[n] = self._time_inversion(n)
            costs = [seconds[n] for n in dims]
        if o.resolved("placement") == "balanced":
            workers = self.inverting_ranks
            placed = placement.balanced(costs, len(workers), replicated)
            return [r if r == placement.EVERY_RANK else workers[r] for r in placed], costs, pack
        spread = iter(placement.round_robin(len(dims) - sum(replicated), ranks))
        return [placement.EVERY_RANK if r else next(spread) for r in replicated], costs, pack

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
        slowest = self.factor_comm.allreduce_(
            torch.tensor([seconds], dtype=torch.float64), op="max", what="unpack timing"
        )
        return saved > float(slowest)

    def _inverting_ranks(self) -> list[int]:
        """The ranks that may own inversions: every rank, except that for a balanced placement a
        node running more ranks than it has cores gives them to as many of its ranks as it
        has cores (more would only time-share those cores, and thrash their caches)."""
        o = self.options
        if o.variant == "d-kfac" or o.resolved("placement") != "balanced" or self.comm.size == 1:
            return list(range(self.comm.size))
        seats = self.comm.allgather_object(self.comm.local_rank < self.comm.cores)
        return [rank for rank, seated in enumerate(seats) if seated]

    def _time_inversion(self, n: int) -> float:
        """Seconds to decompose one n x n factor here, best of a few after a warm-up call;
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
        best = min(times[1:])  # the first call pays for lazy initialisation
        return float(
            self.factor_comm.allreduce_(torch.tensor([best], dtype=torch.float64), op="max", what="inversion timing")
        )

    def placement_loads(self) -> list[float]:
        """Each rank's inversion cost under the placement (n^3 units or measured seconds).

        ``max_over_mean`` of the loads of ``inverting_ranks`` is the placement's balance."""
        return placement.loads(self.inversion_costs, self.owners, self.comm.size)

    # ---------------------------------------------------------------- hooks
    def _on_forward(self, index: int, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if not (self._capturing and module.training and torch.is_grad_enabled()):
            return
        self._capture(2 * index, "forward", lambda out: self.layers[index].computer.compute_a(inputs[0], out))
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(partial(self._on_grad_output, index))

    def _on_grad_output(self, index: int, grad: torch.Tensor) -> None:
        self._capture(2 * index + 1, "backward", lambda out: self.layers[index].computer.compute_g(grad, out))

    def _capture(self, f: int, stream: str, compute: Callable[[torch.Tensor], None]) -> None:
        start = time.perf_counter()
        compute(self.exchange.target(f))
        self.exchange.ready(f)
        now = time.perf_counter()
        self.timings["factor_compute"] += now - start
        if self._fusion_pending:
            self._ready_at[f] = now - self._stream_start.setdefault(stream, now)

    # ----------------------------------------------------------------- step
    def zero_grad(self) -> None:
        self.grads.zero_()

    def no_sync(self) -> AbstractContextManager[None]:
        """Refused: K-FAC's factors come from one forward and backward per step."""
        raise RuntimeError(
            "mpisolve kfac: no_sync() (gradient accumulation) is not supported: the Kronecker factors are "
            "computed from a single forward and backward pass per step. Use one larger batch per step"
        )

    @collective_round
    def synchronize(self, *, scaler: GradScaler | None = None) -> None:
        """Complete the gradients' average now (before preconditioning, which ``step`` does)."""
        self.grads.finish(writable=True)
        self._unscale(scaler)

    @collective_round
    def step(self, batch_size: int | None = None, *, scaler: GradScaler | None = None) -> StepInfo:
        o = self.options
        step = self.steps
        if self._capturing and self.grads.backward_ran and not any(self.exchange.captured):
            raise RuntimeError(
                "mpisolve kfac: backward ran but no layer's Kronecker factors were captured: the layer hooks "
                "did not run. A torch.compile'd module called before the solver was made does not see hooks "
                "added later: make the solver first (or give it the compiled module before its first call)"
            )
        if self._capturing:
            start = time.perf_counter()
            self.exchange.finish()
            middle = time.perf_counter()
            self.timings["factor_comm"] += middle - start
            self._update_factors(scaler)
            self.timings["factor_compute"] += time.perf_counter() - middle
            if self._fusion_pending:
                self._profile()
        if step % o.inv_update_steps == 0:
            self._update_inverses(_schedule(o.damping, step, "damping"))

        def precondition() -> None:
            start = time.perf_counter()
            lr = None if o.lr is None else _schedule(o.lr, step, "lr")
            if lr is not None:
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
            self._precondition()
            self.timings["precondition"] += time.perf_counter() - start

        # The averaged gradients are the same everywhere: every rank decides alike, unasked.
        info = self._bucket_step(self.grads, batch_size, scaler, "averaged gradients", before_update=precondition)
        self.steps += 1
        if self._capturing:
            self.exchange.rearm()
        self._capturing = self.steps % o.factor_update_steps == 0
        return info

    def _shadow_round(self) -> bool:
        return self._shadow_bucket_round(self.grads)

    def _drain(self) -> None:
        """Complete a round some rank left in flight (close): the factors' messages, the gradients'."""
        if self._capturing:
            self.exchange.finish()
        self.grads.finish()

    def _update_factors(self, scaler: GradScaler | None) -> None:
        """Fold this step's summed batch factors into the running averages.

        With a GradScaler, G came from the scaled loss: it is divided by the scale squared,
        and a non-finite G (a step the scaler skips) is left out without a warning.
        """
        scaled = scaler is not None and scaler.is_enabled()
        unscale = 1.0 / scaler.get_scale() ** 2 if scaler is not None and scaled else 1.0
        skipped = []
        for f, factor in enumerate(self.factors):
            batch, count = self.exchange.result(f)
            if count == 0:
                continue
            is_g = f % 2 == 1
            if not math.isfinite(float(batch.sum())):
                if not (scaled and is_g):
                    skipped.append(factor.name)
                continue
            if scaled and is_g:
                batch.mul_(unscale)
            factor.update(batch, count, self.options.factor_decay)
        if skipped:
            self._warn(f"non-finite batch factors (their running averages are left as they were): {', '.join(skipped)}")

    def _update_inverses(self, damping: float) -> None:
        shifts = [0.0] * len(self.factors)
        if self.options.method == "inverse":
            for i, layer in enumerate(self.layers):
                shifts[2 * i], shifts[2 * i + 1] = factored_damping(layer.a, layer.g, damping)
        statuses = self.inverter.run(shifts)
        self.timings["inversion"] += self.inverter.seconds["inversion"]
        self.timings["inverse_comm"] += self.inverter.seconds["inverse_comm"]
        self._damping_used = damping
        for layer in self.layers:
            layer.refresh_scale(damping)
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

    def _precondition(self) -> None:
        o = self.options
        active = [layer for layer in self.layers if layer.ready and layer.spec.module.weight.grad is not None]
        quadratic = 0.0
        for layer in active:
            v = layer.gradient()
            u = layer.precondition(v)
            if o.kl_clip is not None:
                lr = float(self._group_lr[id(layer.spec.module.weight)]["lr"])
                quadratic += lr * lr * float(torch.dot(u.reshape(-1), v.reshape(-1)))
        scale = 1.0
        if o.kl_clip is not None and quadratic != 0.0:
            scale = min(1.0, math.sqrt(o.kl_clip / abs(quadratic)))
        for layer in active:
            layer.write(scale)

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
        self._capturing = self.steps % self.options.factor_update_steps == 0
        self.exchange.rearm()

    def close(self) -> None:
        if not self.closed:
            for hook in self._hooks:
                hook.remove()
            self._end_rounds(busy=self.grads.in_flight or self.exchange.in_flight, drain=self._drain)
            self.grads.close()
            self.exchange.close()
            self.inverter.close()
        super().close()
