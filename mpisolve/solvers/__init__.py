"""Solvers; importing this package registers every one of them."""

from . import adasum  # noqa: F401  (registers "adasum")
from . import allreduce  # noqa: F401  (registers "allreduce")
from . import elastic  # noqa: F401  (registers the EASGD family and EA-wild)
from ..options import OptionError
from .base import Solver, StepInfo, make_solver, register, solvers

__all__ = ["OptionError", "Solver", "StepInfo", "make_solver", "register", "solvers"]
