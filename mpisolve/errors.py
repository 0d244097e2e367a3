"""Every public error mpisolve raises, in one hierarchy.

Pure Python (no torch, no MPI), at the bottom of the house: options, comm, solvers and
train all import from here and nothing here imports them. Each error keeps the builtin
base a caller would reach for (``ValueError`` for bad input, ``RuntimeError`` for a job
that cannot go on), so ``except ValueError`` still catches bad input; ``MpisolveError``
catches everything mpisolve raises on purpose.

::

    MpisolveError
    ├── InputError (ValueError)                 bad input: one line, exit status 2
    │   ├── OptionError                         a solver option
    │   ├── CheckpointError                     a checkpoint that cannot be used
    │   └── CollectiveInputError                bad input every rank agreed on
    │       ├── TensorMismatchError             a collective's tensors differ across ranks
    │       ├── ModelMismatchError              the ranks' models differ
    │       └── UnsupportedModelError           a solver cannot train this model's layout
    ├── CommError (RuntimeError)                the job cannot go on
    │   ├── CommTimeout                         the watchdog fired
    │   ├── PeerClosed                          a peer closed during this rank's round
    │   └── UnevenSteps                         ranks took different numbers of rounds
    └── NonFiniteError (FloatingPointError)     a NaN or Inf was about to reach the model
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CollectiveInputError",
    "CommError",
    "CommTimeout",
    "InputError",
    "ModelMismatchError",
    "MpisolveError",
    "NonFiniteError",
    "OptionError",
    "PeerClosed",
    "TensorMismatchError",
    "UnevenSteps",
    "UnsupportedModelError",
]


class MpisolveError(Exception):
    """The base of every error mpisolve raises on purpose."""


class InputError(MpisolveError, ValueError):
    """Bad user input (a name, a value, a file): reported as one line, exit status 2."""


class OptionError(InputError):
    """A solver option is unknown, of the wrong type, or out of range."""


class CheckpointError(InputError):
    """A checkpoint that cannot be used: missing, foreign, truncated, corrupt, or of another run."""


class CollectiveInputError(InputError):
    """Bad input that every rank has agreed on (``Communicator.agree``): the job can end cleanly."""


class TensorMismatchError(CollectiveInputError):
    """Ranks called a collective with tensors, reductions or roots that do not match (raised on every rank)."""


class ModelMismatchError(CollectiveInputError):
    """Ranks were given models that differ in parameter count, names, shapes or dtypes (raised on every rank)."""


class UnsupportedModelError(CollectiveInputError):
    """A solver cannot train the model as given, e.g. parameters of several dtypes or devices where it needs one.

    Every rank holds the same architecture (checked first), so every rank raises it.
    """


class CommError(MpisolveError, RuntimeError):
    """Communication cannot go on: the job must end."""


class CommTimeout(CommError):
    """A collective or window operation did not complete within the watchdog timeout."""


class PeerClosed(CommError):
    """Another rank reached ``close()`` while this rank waits in a round that rank never took."""


class UnevenSteps(CommError):
    """The ranks ran different numbers of collective rounds (steps) before ``close()``."""


class NonFiniteError(MpisolveError, FloatingPointError):
    """A NaN or Inf was about to reach the model under ``nonfinite="raise"``."""
