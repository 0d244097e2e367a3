"""Checks an installed mpisolve (not the repository's tree): ``make wheel-check`` runs it
from outside the repository with a fresh venv's Python that has only the built wheel.

Imports every module of the repository's tree (``python installed_smoke.py REPO``) from the
installed package and runs every command's and every benchmark's
``--help``, so that a module left out of the wheel fails here rather than on a user's
machine. Not collected by pytest (no ``test_`` prefix): it must not see the repository.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

#: Modules that need an optional GPU stack to import; the rest must import everywhere.
NEEDS_GPU_STACK = ("_cuda",)


def source_modules(repo: Path) -> list[str]:
    """Every module the repository's tree holds, by the name it installs under."""
    names = []
    for root, prefix in ((repo / "mpisolve", "mpisolve"), (repo / "kernels", "mpisolve.kernels")):
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.append(".".join((prefix, *parts)))
    return names


def main(repo: Path) -> int:
    import mpisolve

    here = Path(mpisolve.__file__).resolve()
    if (repo / "mpisolve").resolve() in here.parents:
        sys.exit(f"mpisolve was imported from the repository ({here}), not from the installed wheel")
    modules = source_modules(repo)
    for name in modules:
        if name.endswith("__main__") or name.endswith(NEEDS_GPU_STACK):
            if importlib.util.find_spec(name) is None:
                sys.exit(f"{name} is not in the installed package")
            continue
        importlib.import_module(name)
    from mpisolve.bench import BENCHES
    from mpisolve.cli import COMMANDS

    commands = [["--version"], ["--help"]]
    commands += [[name, "--help"] for name in COMMANDS]
    commands += [["bench", name, "--help"] for name in BENCHES]
    for args in commands:
        done = subprocess.run([sys.executable, "-m", "mpisolve", *args], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"mpisolve {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    print(f"installed mpisolve {mpisolve.__version__}: {len(modules)} modules import, {len(commands)} commands answer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1])))
