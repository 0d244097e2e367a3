"""The user's own code named on the command line: ``MODULE:FACTORY`` (``mypkg.nets:make``).

``MODULE`` is imported as ``python -c "import MODULE"`` would from the current directory
(which is put on ``sys.path`` if it is not there) or ``PYTHONPATH``; ``FACTORY`` is a
callable in it (dots reach into it: ``mypkg.nets:Registry.make``). Every problem (a
module that does not import, a missing or non-callable name, an exception in the
factory) becomes an :class:`InputError` of one line that names it, with the file and
line where the user's code raised.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError


def is_reference(spec: str) -> bool:
    """Whether ``spec`` has the form ``MODULE:NAME`` (dotted identifiers on both sides)."""
    module, sep, name = spec.partition(":")
    return bool(sep) and _dotted(module) and _dotted(name)


def _dotted(text: str) -> bool:
    return all(part.isidentifier() for part in text.split("."))


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """The callable ``MODULE:NAME`` names; ``what`` (``--model``) prefixes every error."""
    if not is_reference(spec):
        raise InputError(f"{what} {spec}: expected MODULE:FACTORY, e.g. mypkg.nets:make")
    module_name, _, name = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: the user's module beside the job
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as err:  # the user's module: any error in it is theirs to see, in one line
        raise InputError(f"{what} {spec}: cannot import {module_name}: {describe(err)}") from None
    for part in name.split("."):
        if not hasattr(target, part):
            raise InputError(f"{what} {spec}: {module_name} has no attribute {name!r}")
        target = getattr(target, part)
    if not callable(target):
        raise InputError(f"{what} {spec}: {name} is a {type(target).__name__}, not a callable")
    return target


def call(factory: Callable[..., Any], spec: str, what: str, given: Mapping[str, Any]) -> Any:
    """``factory(**arguments)``: the entries of ``given`` that it names (all with ``**kwargs``).

    A factory that requires an argument outside ``given`` is refused before the call; an
    exception raised in it becomes an :class:`InputError` naming it.
    """
    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: nothing to give it
        parameters = []
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        arguments = dict(given)
    else:
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        arguments = {p.name: given[p.name] for p in parameters if p.kind in named and p.name in given}
    required = [
        p.name
        for p in parameters
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in arguments
    ]
    if required:
        offered = ", ".join(given) if given else "no arguments"
        raise InputError(f"{what} {spec}: the factory requires {', '.join(required)}; mpisolve gives {offered}")
    try:
        return factory(**arguments)
    except InputError:
        raise
    except Exception as err:  # the user's code
        raise InputError(f"{what} {spec}: the factory raised {describe(err)}") from None


#: Where frames are not the user's code (for :func:`describe`): torch, mpisolve, importlib.
_NOT_USER_CODE = (
    "<frozen",
    *(os.path.dirname(str(package.__file__)) + os.sep for package in (torch, importlib)),
    str(Path(__file__).parents[1]) + os.sep,
)


def describe(err: BaseException) -> str:
    """An exception as one line: ``Type: first line of its message (at file.py:line)``.

    The place is the innermost frame of the user's code: outside torch, mpisolve and
    Python's import machinery.
    """
    if isinstance(err, SyntaxError):
        return f"SyntaxError: {err.msg} (at {Path(err.filename or '?').name}:{err.lineno})"
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(_NOT_USER_CODE)]
    return f"{text} (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else text
