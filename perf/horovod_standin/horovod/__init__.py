"""A stand-in ``horovod`` package whose ``horovod.torch`` is ``mpisolve.horovod``.

For running Horovod's own tests and examples unchanged (perf/horovod_suite.sh); not
installed with mpisolve. ``import horovod.torch as hvd`` gets mpisolve's module itself.
"""

import sys

import mpisolve.horovod as _torch

sys.modules[__name__ + ".torch"] = _torch
for _name in ("mpi_ops", "optimizer", "functions", "compression", "sync_batch_norm"):
    sys.modules[f"{__name__}.torch.{_name}"] = getattr(_torch, _name)
torch = _torch
