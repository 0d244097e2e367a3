"""Solvers; importing this package registers every one of them.

``mpisolve.solvers`` is both this package and the documented ``mpisolve.solvers()``,
which lists the registered names: the package module is made callable for that, since
importing a subpackage always binds its module to the parent's attribute of that name.
"""

import sys
import types

from ..errors import OptionError
from . import (
    abs_sgd,  # noqa: F401  (registers "abs-sgd")
    adasum,  # noqa: F401  (registers "adasum")
    allreduce,  # noqa: F401  (registers "allreduce")
    elastic,  # noqa: F401  (registers the EASGD family and EA-wild)
    kfac,  # noqa: F401  (registers "kfac")
    lb_bsp,  # noqa: F401  (registers "lb-bsp")
    local_sgd,  # noqa: F401  (registers "local-sgd")
)
from .base import Joined, Solver, StepInfo, make_solver, register, solvers

__all__ = ["Joined", "OptionError", "Solver", "StepInfo", "make_solver", "register", "solvers"]


class _SolversPackage(types.ModuleType):
    def __call__(self) -> list[str]:
        """The names of every registered solver."""
        return solvers()


sys.modules[__name__].__class__ = _SolversPackage
