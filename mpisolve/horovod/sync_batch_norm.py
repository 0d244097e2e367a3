"""Horovod's ``SyncBatchNorm``: batch statistics over every rank's batch, on the CPU or a GPU.

Forward sums each channel's values, squares and count over the ranks (one allreduce);
backward sums the two gradient terms that need the whole batch (one more). The affine
parameters' gradients stay this rank's own, for the optimizer's average to combine.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .mpi_ops import Sum, allreduce_async, size, synchronize


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the ranks' batches together.

    Takes ``(N, C, ...)`` inputs like ``torch.nn.BatchNorm1d/2d/3d``; in eval mode (or on
    one rank) it is plain batch norm.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        if not self.training or size() == 1:
            return torch.nn.functional.batch_norm(
                input,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                self.training or not self.track_running_stats,
                factor,
                self.eps,
            )
        return _SyncBatchNorm.apply(
            input, self.weight, self.bias, self.running_mean, self.running_var, self.eps, factor
        )


def _channels(t: torch.Tensor) -> torch.Tensor:
    """``t`` as (C, everything else)."""
    return t.transpose(0, 1).reshape(t.shape[1], -1)


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        momentum: float,
    ) -> torch.Tensor:
        flat = _channels(x).double()
        local = torch.cat(
            [flat.sum(1), (flat * flat).sum(1), torch.tensor([float(flat.shape[1])], dtype=torch.float64)]
        )
        total = synchronize(allreduce_async(local, op=Sum))
        channels = x.shape[1]
        count = total[-1]
        mean = total[:channels] / count
        var = total[channels : 2 * channels] / count - mean * mean
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                unbiased = var * count / (count - 1).clamp(min=1)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = [1, channels] + [1] * (x.dim() - 2)
        xhat = (x.double() - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.count = count
        y = xhat if weight is None else xhat * weight.double().view(shape)
        if bias is not None:
            y = y + bias.double().view(shape)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        dy = grads[0]
        xhat, invstd, weight = ctx.saved_tensors
        channels = dy.shape[1]
        shape = [1, channels] + [1] * (dy.dim() - 2)
        dy64 = dy.double()
        sum_dy = _channels(dy64).sum(1)
        sum_dy_xhat = _channels(dy64 * xhat).sum(1)
        total = synchronize(allreduce_async(torch.cat([sum_dy, sum_dy_xhat]), op=Sum))
        mean_dy, mean_dy_xhat = total[:channels] / ctx.count, total[channels:] / ctx.count
        scale = invstd if weight is None else invstd * weight.double()
        dx = (dy64 - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape)) * scale.view(shape)
        dweight = None if weight is None else sum_dy_xhat.to(weight.dtype)
        dbias = None if weight is None else sum_dy.to(weight.dtype)
        return dx.to(dy.dtype), dweight, dbias, None, None, None, None
