"""Distributed K-FAC: the "kfac" solver (D-KFAC, MPD-KFAC, SPD-KFAC) and its parts."""

from .solver import KFACOptions, KFACSolver

__all__ = ["KFACOptions", "KFACSolver"]
