"""mpisolve: MPI-native distributed training solvers for PyTorch.

The public door::

    import mpisolve
    comm = mpisolve.init()                                  # rank, size, local_rank
    reduced = mpisolve.allreduce(tensors, op="average")     # functional collectives: also allgather,
                                                            # broadcast, alltoall, reducescatter
    solver = mpisolve.make_solver("allreduce", model, optimizer)
    mpisolve.solver_names()                                 # every registered solver's name

Every public error (:mod:`mpisolve.errors`) is here at once; the other names are imported
on first use, so ``import mpisolve`` neither imports torch nor starts MPI: commands that
need neither (``python -m mpisolve plot``) run on a login node.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from . import errors as _errors
from .errors import *  # noqa: F403  (every public error, as errors.__all__ lists them)

if TYPE_CHECKING:  # the lazy names below, typed for checkers; at run time __getattr__ imports them
    from .comm import (
        Communicator,
        allgather,
        allreduce,
        alltoall,
        broadcast,
        init,
        process_set,
        reducescatter,
    )
    from .solvers import Joined, Solver, StepInfo, make_solver, solver_names

__version__ = "0.1.0"

#: public name -> module that defines it, imported on first use (they need torch and MPI)
_EXPORTS = {
    "Communicator": "mpisolve.comm",
    "allgather": "mpisolve.comm",
    "allreduce": "mpisolve.comm",
    "alltoall": "mpisolve.comm",
    "broadcast": "mpisolve.comm",
    "init": "mpisolve.comm",
    "process_set": "mpisolve.comm",
    "reducescatter": "mpisolve.comm",
    "Joined": "mpisolve.solvers",
    "Solver": "mpisolve.solvers",
    "StepInfo": "mpisolve.solvers",
    "make_solver": "mpisolve.solvers",
    "solver_names": "mpisolve.solvers",
}

__all__ = [
    "Communicator",
    "Joined",
    "Solver",
    "StepInfo",
    "allgather",
    "allreduce",
    "alltoall",
    "broadcast",
    "init",
    "make_solver",
    "process_set",
    "reducescatter",
    "solver_names",
]
__all__ += _errors.__all__


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mpisolve' has no attribute {name!r}")
