"""Solvers; importing this package registers every one of them (:func:`solver_names` lists them)."""

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
from .base import Joined, Solver, StepInfo, make_solver, register, solver_names

__all__ = ["Joined", "OptionError", "Solver", "StepInfo", "make_solver", "register", "solver_names"]
