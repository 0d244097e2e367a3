"""Regenerate the options tables of the solver pages (docs/solvers/*.md) from the options dataclasses.

``python -m mpisolve.solvers.option_docs FILE...`` rewrites every table between
``<!-- options: NAME[, NAME...] -->`` and ``<!-- /options -->`` in place (``make docs``);
with ``--check`` it rewrites nothing and exits 1 naming each file whose tables differ
from the code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..options import update_options_tables
from .base import solver_class


def regenerated(text: str) -> str:
    """``text`` with its options tables generated from the registered solvers' options."""
    return update_options_tables(text, lambda name: solver_class(name).Options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpisolve.solvers.option_docs", description=__doc__)
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE")
    parser.add_argument("--check", action="store_true", help="only report files whose tables are stale")
    args = parser.parse_args(argv)
    stale = []
    for path in args.files:
        text = path.read_text()
        new = regenerated(text)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    for path in stale:
        print(f"{path}: options tables {'differ from the code (run make docs)' if args.check else 'regenerated'}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
