"""mpisolve: MPI-native distributed training solvers for PyTorch.

The public door::

    import mpisolve
    comm = mpisolve.init()                                  # rank, size, local_rank
    reduced = mpisolve.allreduce(tensors, op="average")     # functional collective
    solver = mpisolve.make_solver("allreduce", model, optimizer)
    mpisolve.solvers()                                      # every solver's name
"""

from .comm import CommTimeout, Communicator, ModelMismatchError, allreduce, init
from .solvers import OptionError, Solver, StepInfo, make_solver, solvers

__version__ = "0.1.0"

__all__ = [
    "CommTimeout",
    "Communicator",
    "ModelMismatchError",
    "OptionError",
    "Solver",
    "StepInfo",
    "allreduce",
    "init",
    "make_solver",
    "solvers",
]
