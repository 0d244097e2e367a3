"""``python -m mpisolve`` (under MPI: ``mpiexec -n N python -m mpi4py -m mpisolve ...``)."""

from .cli import main

raise SystemExit(main())
