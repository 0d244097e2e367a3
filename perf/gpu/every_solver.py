"""Every registered solver's training step, one after another in one process.

``python -m mpi4py -m perf.gpu.every_solver [bench step options]``, from the repository
root (under ``mpiexec -n N`` for N ranks), runs ``mpisolve bench step --solver NAME`` for
each registered solver: rank 0 prints each one's JSON line; a solver that fails prints its
error as a JSON line and the next one runs. ``perf/gpu/check.sh`` runs it on one GPU at one rank and with two ranks
sharing it.
"""

from __future__ import annotations

import json
import sys
import traceback

import mpisolve
from mpisolve.cli import main


def run_all(extra: list[str]) -> int:
    failed = []
    for name in mpisolve.solvers():
        try:
            status = main(["bench", "step", "--solver", name, *extra])
        except Exception as err:  # noqa: BLE001 - report it and go on to the next solver
            traceback.print_exc()
            print(json.dumps({"solver": name, "error": f"{type(err).__name__}: {err}"}), flush=True)
            status = 1
        if status != 0:
            failed.append(name)
    print(json.dumps({"failed": failed}), file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_all(sys.argv[1:]))
