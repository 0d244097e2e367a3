"""mpisolve: MPI-native distributed training solvers for PyTorch."""
from setuptools import setup

setup(
    name="mpisolve",
    version="0.1.0",
    description="MPI-native distributed training solvers for PyTorch: "
    "allreduce SGD, Adasum, ABS-SGD, distributed K-FAC, the EASGD family and EA-wild",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=[
        "mpisolve",
        "mpisolve.comm",
        "mpisolve.solvers",
        "mpisolve.solvers.kfac",
        "mpisolve.train",
        "mpisolve.bench",
        "mpisolve.kernels",
    ],
    # kernels/ lives at the top of the repository but is installed as mpisolve.kernels.
    package_dir={"mpisolve": "mpisolve", "mpisolve.kernels": "kernels"},
    install_requires=[
        "mpi4py>=4",
        "numpy",
        "numba",
        "torch>=2.1",
        "tomli; python_version < '3.11'",
    ],
    extras_require={
        "test": ["pytest", "pytest-mpi", "pytest-timeout", "scikit-learn", "matplotlib"],
        "mpich": ["mpich"],
        # numba-cuda: NVIDIA's CUDA target for Numba, with the CUDA 12 compiler (NVVM) it needs.
        "gpu": ["cupy-cuda12x", "numba-cuda[cu12]"],
        "train": ["scikit-learn", "matplotlib"],
    },
    entry_points={"console_scripts": ["mpisolve=mpisolve.cli:main"]},
)
