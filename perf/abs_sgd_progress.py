"""How long a persistent allreduce takes when only a thread's periodic tests move it (ABS-SGD's ``progress_ms``).

Write-up, figures and provenance: docs/studies/abs-sgd.md.

Usage: ``mpiexec -n 4 python -m mpi4py perf/abs_sgd_progress.py INTERVAL_MS [FLOATS]``
(default 1.1 M floats, the study's MLP). Every rank starts the allreduce, then a thread
tests it every INTERVAL_MS while the main thread waits for the thread to see it done;
rank 0 prints each rank's median over 20 rounds. MPICH starts each stage of the
reduction at a test, so the time is about (stages) x (interval); set
``MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM`` to compare MPICH's algorithms.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

ROUNDS = 20


def main(interval_ms: float, floats: int) -> None:
    comm = MPI.COMM_WORLD
    data = np.ones(floats, np.float32)
    result = np.empty_like(data)  # referenced until the request is freed: MPI writes into it
    request = comm.Allreduce_init(data, result)
    lock, done, stop = threading.Lock(), threading.Event(), threading.Event()
    watched: list[MPI.Prequest | None] = [None]

    def poll() -> None:
        while not stop.wait(interval_ms / 1e3):
            with lock:
                if watched[0] is not None and watched[0].Test():
                    watched[0] = None
                    done.set()

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    times = []
    for _ in range(ROUNDS):
        comm.Barrier()
        start = time.perf_counter()
        done.clear()
        request.Start()
        with lock:
            watched[0] = request
        done.wait()
        times.append(time.perf_counter() - start)
        request.Wait()
    stop.set()
    thread.join()
    request.Free()
    medians = comm.gather(statistics.median(times) * 1e3)
    if comm.rank == 0:
        library = " ".join(MPI.Get_library_version().split("\n")[0].split())
        print(
            f"{floats} floats, {comm.size} ranks, a test every {interval_ms:g} ms ({library}): "
            f"completed after {', '.join(f'{m:.1f}' for m in medians)} ms (median of {ROUNDS} per rank)"
        )


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1_100_000)
