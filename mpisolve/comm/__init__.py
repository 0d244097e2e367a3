"""Everything that touches MPI. Nothing outside this package imports mpi4py directly,
except for type hints of the communicators users pass in."""

from .closing import PeerClosed, UnevenSteps
from .communicator import CommTimeout, Communicator, as_communicator, init, mpi_buffer
from .ops import TensorMismatchError, allgather, allreduce, alltoall, broadcast, process_set, reducescatter
from .state import ModelMismatchError

__all__ = [
    "CommTimeout",
    "Communicator",
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
