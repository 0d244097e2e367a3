"""The command line: ``python -m mpisolve <command> ...``.

Each command lives in its own module and exposes ``add_arguments(parser)`` and
``run(args) -> int``; this module only routes. Bad arguments exit with status 2 and one
line naming the problem, on every rank.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import CollectiveInputError, InputError

#: command -> (module, one-line help). Modules are imported only when their command runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("mpisolve.bench", "measure collectives, solvers and kernels; print JSON"),
    "train": ("mpisolve.train.loop", "train a model (built-in, torchvision, or your own) with one solver (under MPI)"),
    "compare": ("mpisolve.train.compare", "train with several solvers on one workload; table, JSON, plots"),
    "plot": ("mpisolve.train.plots", "plot test accuracy, loss and samples/s from run logs (no mpiexec needed)"),
    "model": (
        "mpisolve.perfmodel.command",
        "project solvers' iteration time and efficiency to many GPUs (no mpiexec needed)",
    ),
    "advise": ("mpisolve.advise", "measure a model's computation/communication ratio; recommend a solver"),
}


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments: one line naming the problem (``--help`` shows the usage), exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(_fail(f"{self.prog}: error: {message}", every_rank=True))  # every rank parses the same argv


def _fail(line: str, *, every_rank: bool) -> int:
    """Print ``line`` in one write (so ranks' lines do not interleave); return exit status 2.

    When every rank fails alike, MPI is finalized first, so that the job ends without an
    MPI_Abort and its extra lines; after a rank fails alone, ``python -m mpi4py`` aborts
    the job.
    """
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    if every_rank and "mpi4py.MPI" in sys.modules:
        from .comm.communicator import finalize

        finalize()
    return 2


def main(argv: list[str] | None = None) -> int:
    from . import __version__

    parser = OneLineParser(prog="mpisolve", description="MPI-native distributed training solvers")
    parser.add_argument("--version", action="version", version=f"mpisolve {__version__}")
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
        return _fail(f"mpisolve {args.command}: error: {err}", every_rank=isinstance(err, CollectiveInputError))
