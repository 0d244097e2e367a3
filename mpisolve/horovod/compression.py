"""Horovod's ``Compression``: what a tensor is cast to before a collective and back after it.

MPI has no 16-bit arithmetic, so a compressed tensor is summed in float32 all the same
(:mod:`mpisolve.comm.ops`): compression rounds values as Horovod's does, and saves no
bandwidth here.
"""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Casts a tensor before a collective (``compress``) and back after it (``decompress``)."""

    dtype: torch.dtype | None = None

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The tensor to send and what ``decompress`` needs (the original dtype)."""
        if cls.dtype is None or not tensor.dtype.is_floating_point:
            return tensor, None
        return tensor.to(cls.dtype), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The result in the original dtype."""
        return tensor if ctx is None else tensor.to(ctx)


class NoneCompressor(Compressor):
    """No compression (the default)."""


class FP16Compressor(Compressor):
    """Floating-point tensors in float16."""

    dtype = torch.float16


class BF16Compressor(Compressor):
    """Floating-point tensors in bfloat16."""

    dtype = torch.bfloat16


class Compression:
    """The compressions ``hvd.allreduce`` and ``hvd.DistributedOptimizer`` take."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
