"""mpisolve: MPI-native distributed training solvers for PyTorch.

The public door::

    import mpisolve
    comm = mpisolve.init()                                  # rank, size, local_rank
    reduced = mpisolve.allreduce(tensors, op="average")     # functional collectives: also allgather,
                                                            # broadcast, alltoall, reducescatter
    solver = mpisolve.make_solver("allreduce", model, optimizer)
    mpisolve.solvers()                                      # every solver's name

Names are imported on first use, so ``import mpisolve`` neither imports torch nor starts
MPI: commands that need neither (``python -m mpisolve plot``) run on a login node.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

#: public name -> module that defines it
_EXPORTS = {
    "CommTimeout": "mpisolve.comm",
    "Communicator": "mpisolve.comm",
    "ModelMismatchError": "mpisolve.comm",
    "PeerClosed": "mpisolve.comm",
    "TensorMismatchError": "mpisolve.comm",
    "UnevenSteps": "mpisolve.comm",
    "allgather": "mpisolve.comm",
    "allreduce": "mpisolve.comm",
    "alltoall": "mpisolve.comm",
    "broadcast": "mpisolve.comm",
    "init": "mpisolve.comm",
    "process_set": "mpisolve.comm",
    "reducescatter": "mpisolve.comm",
    "Joined": "mpisolve.solvers",
    "OptionError": "mpisolve.options",
    "Solver": "mpisolve.solvers",
    "StepInfo": "mpisolve.solvers",
    "make_solver": "mpisolve.solvers",
}

__all__ = [*_EXPORTS, "solvers"]


def __getattr__(name: str) -> Any:
    if name == "solvers":  # the subpackage, which called lists the solver names
        return import_module("mpisolve.solvers")
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mpisolve' has no attribute {name!r}")
