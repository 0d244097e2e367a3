"""A preconditioned layer: its two factors' running averages and decompositions, and the math.

Factors start as the identity with no updates. The k-th update of a factor averages with
decay ``min(1 - 1/k, factor_decay)``: the first update replaces the identity by the
batch factor, the next ones average the batches seen so far, and from the
``1/(1 - factor_decay)``-th on it is the usual exponential average (so early
preconditioning is not biased towards the identity). Damping is never added to a stored
factor: the decompositions are computed from damped copies.

For the gradient matrix V (``[out, in(+1)]``, bias as the last column):

- eigen: A = Q_A diag(d_A) Q_A^T, G = Q_G diag(d_G) Q_G^T and
  U = Q_G [(Q_G^T V Q_A) / (d_G d_A^T + damping)] Q_A^T, which is exactly
  (A (x) G + damping I)^-1 vec(V) (column-stacking vec);
- inverse: factored Tikhonov damping (Martens and Grosse 2015, section 6.3),
  U = (G + sqrt(damping)/pi I)^-1 V (A + pi sqrt(damping) I)^-1 with
  pi = sqrt((tr A / dim A) / (tr G / dim G)).
"""

from __future__ import annotations

import math

import torch

from ...kernels.triangle import pack_triu, triangle_numel, unpack_triu_
from .factors import FactorComputer, LayerSpec


class Factor:
    """A Kronecker factor: running average, update count and its latest decomposition.

    The running average is kept as the full matrix, or (``packed``) as its upper
    triangle, the layout the factor travels in: the average is then updated in place
    from the received sum, on half the numbers, and only unpacked where it is
    decomposed.
    """

    def __init__(
        self, name: str, dim: int, method: str, dtype: torch.dtype, device: torch.device, packed: bool
    ) -> None:
        self.name = name
        self.dim = dim
        self.method = method
        self.packed = packed
        eye = torch.eye(dim, dtype=dtype, device=device)
        self.running = pack_triu(eye, torch.empty(triangle_numel(dim), dtype=dtype, device=device)) if packed else eye
        rows = torch.arange(dim, device=device)
        #: Where the diagonal lies in the running average's storage.
        self._diagonal = rows * dim - rows * (rows - 1) // 2 if packed else rows * (dim + 1)
        self.updates = 0
        self.inverted = False
        if method == "inverse":
            self.inverse = torch.eye(dim, dtype=dtype, device=device)
        else:
            self.vectors = torch.eye(dim, dtype=dtype, device=device)
            self.values = torch.ones(dim, dtype=dtype, device=device)

    def update(self, batch_sum: torch.Tensor, count: int, decay: float, finite: torch.Tensor) -> None:
        """Fold in the mean of ``count`` ranks' batch factors (``batch_sum``, in the running layout),
        where ``finite`` (a 0-d bool on the factor's device, never read by the host) holds."""
        self.updates += 1
        rate = min(1.0 - 1.0 / self.updates, decay)
        if rate == 0.0:  # a plain replacement (0 * a non-finite old value would stay non-finite)
            new = torch.div(batch_sum, count)
        else:
            new = torch.add(self.running * rate, batch_sum, alpha=(1.0 - rate) / count)
        self.running.copy_(torch.where(finite, new, self.running))

    def fill(self, out: torch.Tensor) -> torch.Tensor:
        """``out <- the running average as a full matrix``."""
        return unpack_triu_(self.running, out) if self.packed else out.copy_(self.running)

    def matrix(self) -> torch.Tensor:
        """The running average as a new full matrix."""
        return self.fill(torch.empty(self.dim, self.dim, dtype=self.running.dtype, device=self.running.device))

    def mean_eigenvalue(self) -> torch.Tensor:
        """tr(F) / dim, a 0-d tensor on the factor's device (not read)."""
        return self.running.view(-1)[self._diagonal].sum() / self.dim

    def decomposition(self) -> list[torch.Tensor]:
        """The tensors the decomposition lives in (the inverse, or eigenvectors and eigenvalues)."""
        return [self.inverse] if self.method == "inverse" else [self.vectors, self.values]

    def state_dict(self) -> dict:
        """Full matrices whatever the layout: a checkpoint loads into any variant."""
        state = {"running": self.matrix(), "updates": self.updates, "inverted": self.inverted}
        if self.method == "inverse":
            state["inverse"] = self.inverse
        else:
            state["vectors"], state["values"] = self.vectors, self.values
        return state

    def load_state_dict(self, state: dict) -> None:
        keys = ["running", "inverse"] if self.method == "inverse" else ["running", "vectors", "values"]
        for key in keys:
            if key not in state:
                raise ValueError(f"K-FAC state of factor {self.name} lacks {key!r} (saved with another method?)")
            expected = (self.dim, self.dim) if key != "values" else (self.dim,)
            if tuple(state[key].shape) != expected:
                raise ValueError(
                    f"K-FAC state of factor {self.name}: {key} has shape {tuple(state[key].shape)}, expected {expected}"
                )
        running = state["running"].to(self.running.dtype).contiguous()
        if self.packed:
            pack_triu(running, self.running)
        else:
            self.running.copy_(running)
        for key in keys[1:]:
            getattr(self, key).copy_(state[key])
        self.updates = int(state["updates"])
        self.inverted = bool(state["inverted"])


def factored_damping(trace_a: float, trace_g: float, damping: float) -> tuple[float, float]:
    """The shifts (for A, for G) of factored Tikhonov damping from the factors' mean eigenvalues
    (:meth:`Factor.mean_eigenvalue`); pi = 1 when a trace is not positive."""
    ratio = trace_a / trace_g if trace_g > 0 else 0.0
    pi = math.sqrt(ratio) if trace_a > 0 and math.isfinite(ratio) and ratio > 0 else 1.0
    root = math.sqrt(damping)
    return pi * root, root / pi


def precondition_matrix(
    method: str,
    g: torch.Tensor,
    a: torch.Tensor,
    scale: torch.Tensor | None,
    v: torch.Tensor,
    work: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out <- the preconditioned gradient matrix`` of ``v``: ``g`` and ``a`` are the damped
    inverses (inverse method) or the eigenvectors (eigen method, with ``scale`` = 1 /
    (d_G d_A^T + damping)); ``work`` is scratch of ``v``'s shape."""
    if method == "inverse":
        torch.mm(g, v, out=work)
        torch.mm(work, a, out=out)
    else:
        assert scale is not None  # the eigen method always has its scale
        torch.mm(g.T, v, out=work)
        torch.mm(work, a, out=out)
        out.mul_(scale)
        torch.mm(g, out, out=work)
        torch.mm(work, a.T, out=out)
    return out


class KFACLayer:
    """One Linear or Conv2d layer: factor computation, preconditioning, and writing back.

    Buffers for the gradient matrix and the intermediate products are allocated once.
    """

    def __init__(self, spec: LayerSpec, method: str, dtype: torch.dtype, device: torch.device, packed: bool) -> None:
        self.spec = spec
        self.method = method
        self.computer = FactorComputer(spec, upper_only=packed)  # packed factors travel as upper triangles
        self.a = Factor(f"{spec.name}.A", spec.a_dim, method, dtype, device, packed)
        self.g = Factor(f"{spec.name}.G", spec.g_dim, method, dtype, device, packed)
        shape = (spec.g_dim, spec.a_dim)
        self._matrix = torch.empty(shape, dtype=dtype, device=device) if self._needs_matrix_copy(dtype) else None
        self._work = torch.empty(shape, dtype=dtype, device=device)
        self.result = torch.empty(shape, dtype=dtype, device=device)
        self._scale = torch.empty(shape, dtype=dtype, device=device) if method == "eigen" else None

    def _needs_matrix_copy(self, dtype: torch.dtype) -> bool:
        return self.spec.has_bias or self.spec.module.weight.dtype != dtype

    @property
    def ready(self) -> bool:
        """Both factors have seen data and been decomposed: preconditioning means something."""
        return self.a.updates > 0 and self.g.updates > 0 and self.a.inverted and self.g.inverted

    def refresh_scale(self, damping: float) -> None:
        """Eigen method: ``1 / (d_G d_A^T + damping)``, after new eigenvalues or damping."""
        if self._scale is not None:
            torch.outer(self.g.values, self.a.values, out=self._scale)
            self._scale.add_(damping).reciprocal_()

    def _grads(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight's gradient, and the bias's when the layer has one."""
        weight, bias = self.spec.module.weight.grad, self.spec.module.bias
        assert weight is not None  # step() preconditions only layers whose weight has a gradient
        if not self.spec.has_bias:
            return weight, None
        assert bias is not None and bias.grad is not None  # a trained bias gets its gradient with the weight's
        return weight, bias.grad

    def gradient(self) -> torch.Tensor:
        """The (averaged) gradient as the ``[out, in(+1)]`` matrix: a view when there is no bias."""
        weight_grad, bias_grad = self._grads()
        weight = weight_grad.view(self.spec.g_dim, -1)
        if self._matrix is None:
            return weight
        features = weight.shape[1]
        self._matrix[:, :features].copy_(weight)
        if bias_grad is not None:
            self._matrix[:, features].copy_(bias_grad)
        return self._matrix

    def precondition(self, v: torch.Tensor) -> torch.Tensor:
        """``self.result <- the preconditioned gradient matrix`` (and return it)."""
        g, a = self.g.decomposition()[0], self.a.decomposition()[0]
        return precondition_matrix(self.method, g, a, self._scale, v, self._work, self.result)

    def write(self, preconditioned: torch.Tensor, scale: torch.Tensor | None) -> None:
        """Where ``preconditioned`` (a 0-d 0/1 flag on the device) is 1, put ``scale`` times the
        preconditioned matrix into the parameters' gradients; where it is 0, leave them.
        Neither is read by the host."""
        weight_grad, bias_grad = self._grads()
        weight = weight_grad.view(self.spec.g_dim, -1)
        features = weight.shape[1]
        targets = [(weight, self.result[:, :features])]
        if bias_grad is not None:
            targets.append((bias_grad, self.result[:, features]))
        weight = preconditioned.to(weight_grad.dtype)
        for grad, value in targets:  # exactly value at 1, exactly grad at 0
            if grad.dtype == value.dtype:
                grad.lerp_(value, weight)
            else:
                grad.copy_(torch.lerp(grad.to(value.dtype), value, preconditioned))
        if scale is not None:
            factor = torch.lerp(torch.ones_like(scale), scale, preconditioned).to(weight_grad.dtype)
            for grad, _ in targets:
                grad.mul_(factor)
