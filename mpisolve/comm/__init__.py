"""Everything that touches MPI.

Nothing outside this package imports mpi4py directly, except for type hints of the
communicators users pass in.
"""

from ..errors import CommTimeout, ModelMismatchError, PeerClosed, TensorMismatchError, UnevenSteps
from .communicator import Communicator, CommunicatorOptions, as_communicator, init, mpi_buffer
from .ops import allgather, allreduce, alltoall, broadcast, process_set, reducescatter

__all__ = [
    "CommTimeout",
    "Communicator",
    "CommunicatorOptions",
    "ModelMismatchError",
    "PeerClosed",
    "TensorMismatchError",
    "UnevenSteps",
    "allgather",
    "allreduce",
    "alltoall",
    "as_communicator",
    "broadcast",
    "init",
    "mpi_buffer",
    "process_set",
    "reducescatter",
]
