"""GPU tensors and MPI: is the library CUDA-aware, host staging when it is not, device choice.

A CUDA-aware MPI library reads and writes device memory itself; mpisolve then hands it
the tensor once the kernels that produced it are done (an event on the current stream,
never a stream synchronize). Any other library gets a pinned host twin of the tensor:
copy to host, MPI on the host buffer, copy back. The twin is allocated once per
:class:`Stager` and reused every time it is started. ``MPISOLVE_STAGE=1`` stages every
tensor, CPU ones too, which runs the staged path's logic without a GPU.
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

#: Forces staging (``1``): every tensor, CPU ones too, reaches MPI through its own host buffer.
#: Unset or ``0``: CUDA tensors are staged exactly when MPI is not CUDA-aware. This is how
#: the staged path (host twins, the copies around MPI) is exercised without a GPU.
STAGE_ENV = "MPISOLVE_STAGE"

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


def detect_stage_all(option: bool | None = None) -> bool:
    """Whether every tensor is to be staged through host memory: ``option``, else ``MPISOLVE_STAGE=0/1``."""
    if option is not None:
        if not isinstance(option, bool):
            raise TypeError(f"stage_all must be True, False or None, got {option!r}")
        return option
    value = os.environ.get(STAGE_ENV, "0").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"{STAGE_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


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

    Direct (``host=None``): MPI works on the tensor itself. Staged (``host`` given: pinned
    for a CUDA tensor): MPI works on ``host``. Nothing here blocks the host:

    - :meth:`to_mpi` queues what makes :attr:`memory` ready: for a CUDA tensor, the copy
      to ``host`` (staged), then an event on the current stream, after every kernel queued
      so far (those that wrote the tensor, or still read a buffer MPI is to write);
    - :meth:`ready` says whether that event has passed: MPI may start on :attr:`memory`
      (:meth:`Communicator.start` posts an operation once it is);
    - :meth:`from_mpi` brings what MPI left into the tensor, a copy queued on the current
      stream (staged), which later work on that stream sees.

    A CPU tensor is ready at once; it can be staged too (a copy to a separate host
    buffer), which is how the staged path is tested without a GPU. Work between
    :meth:`to_mpi` and the end of the MPI operation must not touch the tensor.
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
        # Passed once the work queued before to_mpi is done: MPI may use the memory.
        self._ready = torch.cuda.Event() if self._cuda else None
        #: Host memory: ready for MPI whenever it is asked (:meth:`ready` is always True).
        self.always_ready = self._ready is None
        # Marks the copy back to the device, which reads the host buffer after from_mpi returns.
        self._copied_back = torch.cuda.Event() if self._cuda and host is not None else None

    @classmethod
    def staged(cls, tensor: torch.Tensor) -> Stager:
        """A stager with its own host twin of ``tensor`` (pinned if ``tensor`` is on a GPU)."""
        return cls(tensor, host_twin(tensor))

    def to_mpi(self, values: bool = True) -> None:
        """Queue what makes :attr:`memory` ready for MPI; :meth:`ready` says when it is.

        ``values``: MPI reads the tensor's values (a send, an in-place reduction). False:
        MPI only writes :attr:`memory` (a receive): nothing is copied, but MPI still waits
        for the work queued so far, which may read the buffer it is about to overwrite.
        """
        if self._ready is not None:
            stream = torch.cuda.current_stream(self.tensor.device)
            if self._copied_back is not None:
                # The last copy back, maybe queued on another stream, must have read the host buffer.
                stream.wait_event(self._copied_back)
            if values and self.host is not None:
                self.host.copy_(self.tensor, non_blocking=True)
            self._ready.record(stream)
        elif values and self.host is not None:
            self.host.copy_(self.tensor)

    def ready(self) -> bool:
        """Whether MPI may use :attr:`memory`: what was queued before :meth:`to_mpi` is done."""
        return self._ready is None or self._ready.query()

    def from_mpi(self) -> None:
        """Bring what MPI left in :attr:`memory` into the tensor (queued on the current stream)."""
        if self.host is not None:
            self.tensor.copy_(self.host, non_blocking=self._cuda)
        if self._copied_back is not None:
            self._copied_back.record(torch.cuda.current_stream(self.tensor.device))


def host_twin(tensor: torch.Tensor) -> torch.Tensor:
    """A host buffer of ``tensor``'s shape and dtype (pinned if ``tensor`` is on a GPU), for staging."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")
