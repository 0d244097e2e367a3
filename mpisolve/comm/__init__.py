"""Everything that touches MPI. Nothing outside this package imports mpi4py directly,
except for type hints of the communicators users pass in."""

from .closing import PeerClosed, UnevenSteps
from .collectives import allreduce
from .communicator import CommTimeout, Communicator, as_communicator, init, mpi_buffer
from .state import ModelMismatchError

__all__ = [
    "CommTimeout",
    "Communicator",
    "ModelMismatchError",
    "PeerClosed",
    "UnevenSteps",
    "allreduce",
    "as_communicator",
    "init",
    "mpi_buffer",
]
