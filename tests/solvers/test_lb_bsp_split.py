"""LB-BSP's batch split and speed parsing (no MPI)."""

import pytest

from mpisolve.options import OptionError
from mpisolve.solvers.lb_bsp import parse_speeds, proportional_batches


def test_batches_are_proportional_to_speed_and_sum_to_the_total():
    assert proportional_batches((1.0, 1.0, 1.0, 0.25), 128) == [39, 39, 39, 11]
    assert proportional_batches((3.0, 1.0), 8) == [6, 2]
    assert proportional_batches((1.0, 1e-9), 2) == [1, 1]  # everyone gets a sample


def test_bad_speeds_are_named():
    assert parse_speeds("1, 2.5") == (1.0, 2.5)
    with pytest.raises(OptionError, match="'measure' or comma-separated numbers"):
        parse_speeds("fast,slow")
    with pytest.raises(OptionError, match="every speed must be finite and > 0, got '0'"):
        parse_speeds("1,0")
    with pytest.raises(OptionError, match="cannot give each of 3 ranks"):
        proportional_batches((1.0, 1.0, 1.0), 2)
