"""Where the suite runs the GPU twins' torch-facing functions: on the GPU when there is one,
else on CPU tensors under Numba's CUDA simulator (tests/conftest.py turns it on), which
stand for device tensors there (``mpisolve.kernels.dispatch.simulating``)."""

import contextlib

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def side_stream():
    """On a GPU, a stream other than the default one, which the kernels must follow; else nothing."""
    if DEVICE.type != "cuda":
        yield
        return
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()
