"""Solver options: declaration, validation and command-line parsing."""

from dataclasses import dataclass
from typing import Literal

import pytest

from mpisolve.errors import OptionError
from mpisolve.options import build_options, option_fields, options_to_dict, parse_option, require


@dataclass(frozen=True, kw_only=True)
class Opts:
    lr: float = 0.1
    steps: int = 10
    mode: Literal["delta", "gradient"] = "delta"
    clip: float | None = None
    fast: bool = False

    def __post_init__(self):
        require(self.steps > 0, f"steps must be > 0, got {self.steps}")


def test_defaults_and_values():
    o = build_options("s", Opts, {"lr": 1, "mode": "gradient", "clip": None})
    assert o.lr == 1 and o.mode == "gradient" and o.clip is None and o.steps == 10


@pytest.mark.parametrize(
    "given, message",
    [
        ({"nope": 1}, "does not take option 'nope'"),
        ({"steps": 1.5}, "option 'steps' of solver 's' must be int"),
        ({"mode": "other"}, "must be one of 'delta', 'gradient'"),
        ({"steps": 0}, "steps must be > 0, got 0"),
        ({"fast": 1}, "must be bool"),
    ],
)
def test_bad_options_are_named(given, message):
    with pytest.raises(OptionError, match=message):
        build_options("s", Opts, given)


def test_parse_from_text():
    assert parse_option("s", Opts, "lr", "1e-3") == 1e-3
    assert parse_option("s", Opts, "steps", "7") == 7
    assert parse_option("s", Opts, "clip", "none") is None
    assert parse_option("s", Opts, "clip", "0.5") == 0.5
    assert parse_option("s", Opts, "fast", "yes") is True
    assert parse_option("s", Opts, "mode", "gradient") == "gradient"
    with pytest.raises(OptionError, match="must be int"):
        parse_option("s", Opts, "steps", "seven")
    with pytest.raises(OptionError, match="does not take option 'x'"):
        parse_option("s", Opts, "x", "1")


def test_fields_and_dict():
    assert option_fields(Opts)["steps"] == (int, 10)
    assert options_to_dict(Opts())["mode"] == "delta"
