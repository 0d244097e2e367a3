"""Who drives MPI's progress engine while a rank computes, and the thread of ours that can.

Most MPI libraries move a nonblocking operation along only while some thread of the
process is inside an MPI call. A rank busy with forward and backward passes then leaves
its collectives and passive-target operations standing. Two remedies:

- a :class:`ProgressThread` of ours that calls into MPI every ``PROGRESS_INTERVAL_S``
  (mpi4py releases the GIL inside MPI calls, so it runs beside torch's kernels); it needs
  ``MPI_THREAD_MULTIPLE`` (mpi4py's default);
- MPICH's own progress thread, which the job must be launched with
  (``MPICH_ASYNC_PROGRESS=1``); it busy-polls a core.

:data:`Progress` names the choice, one vocabulary for every option called ``progress``
(``"none"``: neither remedy, the rank's own MPI calls alone; ``"auto"``: a thread of ours
where a rank has a core to spare for it, else none); :func:`check_progress` checks, up
front, that the remedy asked for is available, and :func:`resolve_progress` makes
``"auto"`` a choice.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from mpi4py import MPI

from ..errors import OptionError
from ..options import require_choice

if TYPE_CHECKING:
    from .communicator import Communicator

#: Who moves MPI's operations along while a rank computes: a thread of ours, MPICH's progress
#: thread, or neither (the rank's own MPI calls, or the library alone); ``"auto"``: see
#: :func:`resolve_progress`.
Progress = Literal["auto", "thread", "mpich", "none"]

#: Under ``"auto"``, a CPU rank runs a thread of ours only with this many cores to itself: one to
#: compute on and one for the thread. With fewer, the thread's wake-ups take turns with the
#: rank's compute on its core (and for the GIL), which costs more than the progress it makes.
THREAD_MIN_CORES = 2

#: How often a progress thread calls into MPI.
PROGRESS_INTERVAL_S = 5e-4


def threads_multiple() -> bool:
    """Whether MPI was initialised with ``MPI_THREAD_MULTIPLE`` (several threads may call it at once)."""
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


def check_progress(progress: str) -> None:
    """Raise :class:`OptionError` unless ``progress`` is a :data:`Progress` this MPI can make."""
    require_choice("progress", progress, Progress)
    if progress not in ("auto", "none"):
        require_async_progress(progress)


def resolve_progress(progress: Progress, comm: Communicator) -> Progress:
    """``progress`` checked (:func:`check_progress`), with ``"auto"`` made a choice for ``comm``'s rank:
    ``"thread"`` where the thread has a core to itself (the rank computes on a GPU, its core
    waiting for the device meanwhile, or has :data:`THREAD_MIN_CORES` cores or more), given
    ``MPI_THREAD_MULTIPLE``; else ``"none"``."""
    check_progress(progress)
    if progress != "auto":
        return progress
    spare = comm.device.type == "cuda" or comm.cores_per_rank >= THREAD_MIN_CORES
    return "thread" if spare and threads_multiple() else "none"


def require_async_progress(mode: str) -> None:
    """Raise :class:`OptionError` unless MPI can be progressed by ``"thread"`` (ours) or ``"mpich"``."""
    if mode not in ("thread", "mpich"):
        raise ValueError(f"no asynchronous progress mode {mode!r}")
    if not threads_multiple():
        raise OptionError(
            f"progress={mode!r} needs MPI initialised with MPI_THREAD_MULTIPLE "
            "(mpi4py's default; check mpi4py.rc.thread_level)"
        )
    if mode == "mpich":
        if not MPI.Get_library_version().startswith("MPICH"):
            raise OptionError("progress='mpich' needs MPICH; use progress='thread' with this MPI")
        if os.environ.get("MPICH_ASYNC_PROGRESS") != "1":
            raise OptionError(
                "progress='mpich' needs the job launched with MPICH_ASYNC_PROGRESS=1 "
                "(e.g. mpiexec -genv MPICH_ASYNC_PROGRESS 1 ...); or use progress='thread'"
            )


class ProgressThread:
    """Calls ``poke`` (something that enters MPI) every ``interval_s`` until :meth:`stop`."""

    def __init__(self, poke: Callable[[], None], *, name: str, interval_s: float = PROGRESS_INTERVAL_S) -> None:
        self._poke = poke
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._poke()

    def stop(self) -> None:
        """Stop poking and wait for the thread to end (idempotent)."""
        self._stop.set()
        self._thread.join()
