"""Package discovery with one mapping: ``kernels/`` (top of the repository) installs as ``mpisolve.kernels``.

Everything else is declared in pyproject.toml.
"""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["mpisolve", "mpisolve.*"]),
        "mpisolve.kernels",
        *(f"mpisolve.kernels.{name}" for name in find_packages("kernels")),
    ],
)
