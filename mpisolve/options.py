"""Solver options: declared as frozen dataclasses, validated up front, parsed from text.

Pure Python (no torch, no MPI), so the command line can check every value before any
rank starts MPI or training.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from .errors import OptionError

T = TypeVar("T")


def require(condition: bool, message: str) -> None:
    """Raise :class:`OptionError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise OptionError(message)


def choices(literal: Any) -> tuple[str, ...]:
    """The values of a ``Literal[...]`` of strings, in order: the one list a choice's checks and help read."""
    return typing.get_args(literal)


def require_choice(name: str, value: object, literal: Any) -> None:
    """Raise :class:`OptionError` unless ``value`` is one of ``literal``'s values."""
    allowed = choices(literal)
    require(value in allowed, f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def build_options(solver: str, cls: type[T], given: dict[str, Any]) -> T:
    """Instantiate a solver's options dataclass from keywords, with errors that name the problem."""
    names = [f.name for f in dataclasses.fields(cast(Any, cls))]
    for key in given:
        if key not in names:
            takes = ", ".join(sorted(names)) if names else "no options"
            raise OptionError(f"solver {solver!r} does not take option {key!r} (it takes: {takes})")
    hints = typing.get_type_hints(cls)
    for key, value in given.items():
        if not _matches(value, hints[key]):
            raise OptionError(f"option {key!r} of solver {solver!r} must be {_type_name(hints[key])}, got {value!r}")
    return cls(**given)


def option(default: Any, help: str, *, at_least: float | None = None, above: float | None = None) -> Any:
    """A dataclass field with a default and a one-line ``help`` (the meaning in the docs' options tables).

    ``at_least`` / ``above``: the field's bound (``above``: finite too), which :class:`Options`
    checks, so that a bound is declared with its option and not in a ``__post_init__``.
    """
    return dataclasses.field(default=default, metadata={"help": help, "at_least": at_least, "above": above})


def with_default(cls: type, name: str, default: Any) -> Any:
    """Field ``name`` of the options dataclass ``cls`` with another default; its help stays ``cls``'s.

    For a subclass whose solver needs another default: the option is still explained once.
    """
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return dataclasses.field(default=default, metadata=field.metadata)


@dataclass(frozen=True, kw_only=True)
class Options:
    """The root of every options dataclass.

    Each class that checks its fields does so in ``__post_init__``, calling
    ``super().__post_init__()`` first, so that the mixins below combine in any order.
    """

    def __post_init__(self) -> None:
        """The checks every field declares: its bound (:func:`option`), its ``Literal``'s values."""
        for name, literal, at_least, above in _declared_checks(type(self)):
            value = getattr(self, name)
            if literal is not None:
                require_choice(name, value, literal)
            if value is None:
                continue
            if at_least is not None:
                require(value >= at_least, f"{name} must be >= {at_least:g}, got {value}")
            if above is not None:
                require(math.isfinite(value) and value > above, f"{name} must be > {above:g}, got {value}")


#: Each options class's declared checks, found once (:func:`_declared_checks`).
_CHECKS: dict[type, list[tuple[str, Any, float | None, float | None]]] = {}


def _declared_checks(cls: type) -> list[tuple[str, Any, float | None, float | None]]:
    """Each field of ``cls`` that declares a check: (name, its ``Literal`` or None, at_least, above)."""
    checks = _CHECKS.get(cls)
    if checks is None:
        hints = typing.get_type_hints(cls)
        checks = _CHECKS[cls] = []
        for f in dataclasses.fields(cls):
            literal = hints[f.name] if typing.get_origin(hints[f.name]) is typing.Literal else None
            at_least, above = f.metadata.get("at_least"), f.metadata.get("above")
            if literal is not None or at_least is not None or above is not None:
                checks.append((f.name, literal, at_least, above))
    return checks


@dataclass(frozen=True, kw_only=True)
class BucketOptions(Options):
    """Gradients (or deltas) laid in fused buckets, each reduced as one unit."""

    bucket_mb: float = option(
        25.0,
        "size of the fused buckets, each reduced as one unit, in MB (10^6 bytes), as DDP's bucket_cap_mb",
        above=0,
    )


@dataclass(frozen=True, kw_only=True)
class LocalStepsOptions(Options):
    """Local steps between exchanges with the other ranks."""

    tau: int = option(
        4,
        "local steps between exchanges with the other ranks (an average, an elastic exchange, a push); 1: every step",
        at_least=1,
    )


@dataclass(frozen=True, kw_only=True)
class MeasureOptions(Options):
    """How the ranks' speeds are measured where a solver splits the batch by speed."""

    measure_batches: int = option(
        3,
        "timed micro-batches per rank, after one warm-up, whose median gives its speed when speeds are measured",
        at_least=1,
    )


def option_fields(cls: type) -> dict[str, tuple[Any, Any]]:
    """Option name -> (type, default) for a solver's options dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f.default) for f in dataclasses.fields(cls)}


def options_table(solvers: Sequence[tuple[str, type]]) -> str:
    """A Markdown table of solvers' options: option, type, default, meaning (from each field's ``help``).

    With several solvers (one page for a family), a column says which solvers take each
    option, and a default that differs between them is given per solver. Rows follow the
    field order of the solver with the most options. A field without ``help`` metadata
    gets an empty meaning.
    """
    rows: dict[str, list[tuple[str, dataclasses.Field[Any], Any]]] = {}
    for _, cls in sorted(solvers, key=lambda solver: -len(dataclasses.fields(solver[1]))):
        for f in dataclasses.fields(cls):  # rows in the order of the solver with the most options
            rows.setdefault(f.name, [])
    for name, cls in solvers:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            rows[f.name].append((name, f, hints[f.name]))
    several = len(solvers) > 1
    lines = ["| option | " + ("solvers | " if several else "") + "type | default | meaning |"]
    lines.append("| --- | " + ("--- | " if several else "") + "--- | --- | --- |")
    for option_name, takers in rows.items():
        names = [name for name, _, _ in takers]
        defaults: dict[str, list[str]] = {}
        for name, f, _ in takers:
            defaults.setdefault(_default_text(f), []).append(name)
        if len(defaults) == 1:
            default = next(iter(defaults))
        else:
            default = "; ".join(f"{text} ({', '.join(who)})" for text, who in defaults.items())
        meaning = next((f.metadata["help"] for _, f, _ in takers if f.metadata.get("help")), "")
        cells = [f"`{option_name}`"]
        if several:
            cells.append("all" if len(names) == len(solvers) else ", ".join(f"`{n}`" for n in names))
        cells += [_doc_type(takers[0][2]), default, meaning]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


#: A generated options table in a Markdown page: the solvers it covers, then the table.
OPTIONS_TABLE = re.compile(r"(<!-- options: ([a-z0-9, -]+?) -->\n)(.*?)(<!-- /options -->)", re.DOTALL)


def update_options_tables(text: str, options_of: Callable[[str], type]) -> str:
    """``text`` with every table between ``<!-- options: a, b -->`` and ``<!-- /options -->`` regenerated."""

    def regenerate(match: re.Match[str]) -> str:
        names = [name.strip() for name in match.group(2).split(",")]
        return match.group(1) + options_table([(name, options_of(name)) for name in names]) + match.group(4)

    return OPTIONS_TABLE.sub(regenerate, text)


def _default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"


def _doc_type(kind: Any) -> str:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_doc_type(k) for k in typing.get_args(kind))
    if origin is typing.Literal:
        return " or ".join(f'`"{c}"`' if isinstance(c, str) else f"`{c!r}`" for c in typing.get_args(kind))
    if kind is type(None):
        return "`None`"
    if origin is Callable or kind is Callable:
        return "callable"
    return f"`{getattr(origin or kind, '__name__', str(kind))}`"


def parse_option(solver: str, cls: type, key: str, text: str) -> Any:
    """Parse ``text`` (from ``--set key=text``) as the declared type of option ``key``."""
    fields = option_fields(cls)
    if key not in fields:
        takes = ", ".join(sorted(fields)) if fields else "no options"
        raise OptionError(f"solver {solver!r} does not take option {key!r} (it takes: {takes})")
    kind = fields[key][0]
    for candidate in _alternatives(kind):
        try:
            value = _parse_as(candidate, text)
        except ValueError:
            continue
        return value
    raise OptionError(f"option {key!r} of solver {solver!r} must be {_type_name(kind)}, got {text!r}")


def options_to_dict(options: Any) -> dict[str, Any]:
    """Options as plain data for logs and checkpoints (callables shown by name)."""
    out = {}
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        out[f.name] = getattr(value, "__name__", repr(value)) if callable(value) else value
    return out


def _alternatives(kind: Any) -> tuple[Any, ...]:
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return typing.get_args(kind)
    return (kind,)


def _parse_as(kind: Any, text: str) -> Any:
    if kind is type(None):
        if text.lower() in ("none", "null"):
            return None
        raise ValueError(text)
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(text)
    if kind in (int, float, str):
        return kind(text)
    if typing.get_origin(kind) is typing.Literal:
        for choice in typing.get_args(kind):
            if str(choice) == text:
                return choice
        raise ValueError(text)
    raise ValueError(f"cannot parse {kind} from the command line")


def _matches(value: Any, kind: Any) -> bool:
    if kind is Any:
        return True
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, k) for k in typing.get_args(kind))
    if origin is typing.Literal:
        return value in typing.get_args(kind)
    if kind is type(None):
        return value is None
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is Callable or kind is Callable or origin is typing.Callable:
        return callable(value)
    if origin in (tuple, list):
        return isinstance(value, origin)
    if isinstance(kind, type):
        return isinstance(value, kind)
    return True


def _type_name(kind: Any) -> str:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(k) for k in typing.get_args(kind))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(kind))
    if kind is type(None):
        return "None"
    return getattr(kind, "__name__", str(kind))
