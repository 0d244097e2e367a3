"""A model's parameters as views into one flat tensor, for the solvers that move the whole model.

Local SGD, the EASGD family and the asynchronous solvers average, exchange or push all of
a rank's parameters at once: laid end to end in one buffer, each exchange is one message
(with counts riding at its end: :class:`~mpisolve.comm.buckets.HostTally`).
"""

from __future__ import annotations

import torch

from ..comm.buckets import FusedBuffer
from ..errors import UnsupportedModelError


def flatten_parameters(
    params: list[torch.nn.Parameter], *, who: str = "the EASGD family", extra: int = 0
) -> torch.Tensor:
    """Make ``params`` views into one flat tensor on their device (one copy, now) and return it.

    ``extra`` trailing elements follow the parameters (e.g. a sample count that rides
    along in the same message); ``who`` names the solver in errors.
    """
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.float64}:
        found = ", ".join(sorted(map(str, dtypes)))
        raise UnsupportedModelError(f"{who} needs parameters of one dtype, float32 or float64; got {found}")
    devices = {p.device for p in params}
    if len(devices) != 1:
        raise UnsupportedModelError(f"{who} needs parameters on one device; got {', '.join(sorted(map(str, devices)))}")
    flat = FusedBuffer([p.shape for p in params], params[0].dtype, params[0].device, extra=extra)
    flat.pack([p.detach() for p in params])
    for p, view in zip(params, flat.views):
        p.data = view
    return flat.flat
