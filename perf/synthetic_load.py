"""A synthetic workload for perf/model_calibration.py: a fixed amount of computing per step and
a chosen number of parameters, so that the calibration of ranks sharing cores does not
reuse the scaling study's workloads (``--model perf.synthetic_load:make``).

The forward pass multiplies a 96 x 96 matrix ``MPISOLVE_SYNTH_LOOPS`` times (outside
autograd) and adds a linear classifier and a ballast parameter of
``MPISOLVE_SYNTH_NUMEL`` elements, whose gradient (zeros) every solver exchanges.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn


class SyntheticLoad(nn.Module):
    def __init__(self, in_shape: tuple[int, ...], classes: int, numel: int, loops: int) -> None:
        super().__init__()
        self.head = nn.Linear(math.prod(in_shape), classes)
        self.ballast = nn.Parameter(torch.zeros(numel))
        self.register_buffer("work", torch.randn(96, 96) / 96)
        self.loops = loops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for _ in range(self.loops):
                torch.mm(self.work, self.work)
        return self.head(x.flatten(1)) + 0 * self.ballast.sum()


def make(in_shape: tuple[int, ...], classes: int) -> nn.Module:
    """The workload the environment describes (MPISOLVE_SYNTH_NUMEL, MPISOLVE_SYNTH_LOOPS)."""
    return SyntheticLoad(
        in_shape, classes, int(os.environ["MPISOLVE_SYNTH_NUMEL"]), int(os.environ["MPISOLVE_SYNTH_LOOPS"])
    )
