"""GPU tensors and MPI: is the library CUDA-aware, host staging when it is not, device choice.

A CUDA-aware MPI library reads and writes device memory itself; mpisolve then hands it
the tensor after synchronizing the stream that produced it. Any other library gets a
pinned host twin of the tensor: copy to host, MPI on the host buffer, copy back. The
twin is allocated once per :class:`Stager` and reused every time it is started.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Mapping

import torch
from mpi4py import MPI

#: Forces CUDA-awareness on (``1``) or off (``0``); ``auto`` or unset detects it.
CUDA_AWARE_ENV = "MPISOLVE_CUDA_AWARE"

#: Variables with which a user turns on (``1``) or off (``0``) their MPI library's GPU
#: support: Cray MPICH (needs its GTL library, from a craype-accel module), MVAPICH2(-GDR), MPICH.
VENDOR_ENV = ("MPICH_GPU_SUPPORT_ENABLED", "MV2_USE_CUDA", "MPIR_CVAR_ENABLE_GPU")


def detect_cuda_aware(option: bool | None = None) -> tuple[bool, str]:
    """Whether MPI may be given CUDA device memory, and what decided it.

    In order: ``option``; ``MPISOLVE_CUDA_AWARE=0/1``; the library's own runtime answer,
    ``MPIX_Query_cuda_support()`` (Open MPI >= 2.0, MPICH >= 4, MVAPICH2 >= 2.3.4);
    a vendor switch from :data:`VENDOR_ENV` set to 0 or 1; otherwise not aware, which is
    always correct (staging through host memory), only slower.
    """
    if option is not None:
        if not isinstance(option, bool):
            raise TypeError(f"cuda_aware must be True, False or None, got {option!r}")
        return option, f"option cuda_aware={option}"
    forced = os.environ.get(CUDA_AWARE_ENV, "auto").strip().lower()
    if forced not in ("0", "1", "auto", ""):
        raise ValueError(f"{CUDA_AWARE_ENV} must be 0, 1 or auto, got {forced!r}")
    if forced in ("0", "1"):
        return forced == "1", f"{CUDA_AWARE_ENV}={forced}"
    queried = query_cuda_support()
    if queried is not None:
        return queried, f"MPIX_Query_cuda_support() = {int(queried)}"
    return vendor_switch(os.environ) or (False, "no evidence of CUDA-aware MPI: staging through host memory")


def vendor_switch(environ: Mapping[str, str]) -> tuple[bool, str] | None:
    """The first of :data:`VENDOR_ENV` set to 0 or 1 in ``environ``, as (on, what said so)."""
    for name in VENDOR_ENV:
        value = environ.get(name, "").strip()
        if value in ("0", "1"):
            return value == "1", f"{name}={value}"
    return None


@functools.cache
def query_cuda_support() -> bool | None:
    """``MPIX_Query_cuda_support()`` of the loaded MPI library, or None where it lacks the call."""
    try:
        # The handle of mpi4py's extension module also finds symbols of the libmpi it links.
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    query.restype = ctypes.c_int
    query.argtypes = []
    return bool(query())


def local_device(local_rank: int) -> torch.device:
    """The device this rank computes on: GPU ``local_rank % count`` when CUDA is available, else the CPU.

    Where the launcher gives each rank one visible GPU (``CUDA_VISIBLE_DEVICES``), the
    count is 1 and every rank takes its own GPU as ``cuda:0``.
    """
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


class Stager:
    """The memory MPI works on for one contiguous tensor, and the copies around each use.

    Direct (``host=None``): MPI works on the tensor itself; for a CUDA tensor
    :meth:`to_mpi` first synchronizes the current stream, so MPI sees the finished
    values. Staged (``host`` given: pinned for a CUDA tensor): :meth:`to_mpi` copies the
    tensor into ``host`` and waits for that copy; MPI works on ``host``;
    :meth:`from_mpi` copies the result back, queued on the current stream (later work
    on that stream sees it; the host is not blocked). A CPU tensor can be staged too,
    which is how the host-side logic is tested without a GPU.
    """

    def __init__(self, tensor: torch.Tensor, host: torch.Tensor | None = None) -> None:
        if not tensor.is_contiguous():
            raise ValueError("MPI needs a contiguous tensor")
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(f"mpisolve moves CPU and CUDA tensors over MPI, not {tensor.device.type} ones")
        if host is not None and (host.device.type != "cpu" or host.shape != tensor.shape or host.dtype != tensor.dtype):
            raise ValueError("a staging buffer must be a CPU tensor of the tensor's shape and dtype")
        self.tensor = tensor
        self.host = host
        self.memory = tensor if host is None else host
        self._cuda = tensor.device.type == "cuda"
        # Marks the copy back to the device, which reads the host buffer after from_mpi returns.
        self._copied_back = torch.cuda.Event() if self._cuda and host is not None else None

    @classmethod
    def staged(cls, tensor: torch.Tensor) -> Stager:
        """A stager with its own host twin of ``tensor`` (pinned if ``tensor`` is on a GPU)."""
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")
        return cls(tensor, host)

    def to_mpi(self) -> None:
        """Make :attr:`memory` hold the tensor's current values, ready for MPI."""
        if self._copied_back is not None:
            # The last copy back may still read the host buffer (on another stream, say).
            torch.cuda.current_stream(self.tensor.device).wait_event(self._copied_back)
        if self.host is not None:
            self.host.copy_(self.tensor, non_blocking=self._cuda)
        if self._cuda:
            torch.cuda.current_stream(self.tensor.device).synchronize()

    def from_mpi(self) -> None:
        """Bring what MPI left in :attr:`memory` into the tensor."""
        if self.host is not None:
            self.tensor.copy_(self.host, non_blocking=self._cuda)
        if self._copied_back is not None:
            self._copied_back.record(torch.cuda.current_stream(self.tensor.device))
