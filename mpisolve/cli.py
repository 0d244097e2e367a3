"""The command line: ``python -m mpisolve <command> ...``.

Each command lives in its own module and exposes ``add_arguments(parser)`` and
``run(args) -> int``; this module only routes. Bad arguments exit with status 2 and one
line naming the problem, on every rank.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .options import InputError

#: command -> (module, one-line help). Modules are imported only when their command runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("mpisolve.bench", "measure collectives, solvers and kernels; print JSON"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpisolve", description="MPI-native distributed training solvers")
    sub = parser.add_subparsers(dest="command", metavar="command")
    sub.required = True
    modules = {}
    argv = sys.argv[1:] if argv is None else argv
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == wanted:
            modules[name] = importlib.import_module(module)
            modules[name].add_arguments(p)
    args = parser.parse_args(argv)
    try:
        return modules[args.command].run(args)
    except InputError as err:
        print(f"mpisolve {args.command}: error: {err}", file=sys.stderr)
        return 2
