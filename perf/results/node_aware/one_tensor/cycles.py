"""`mpisolve.allreduce` of small tensors whose signatures alternate on one communicator, against one signature.

Run on every rank (`mpiexec ... python cycles.py`): the slowest rank's mean per call, in microseconds, of
one signature (a 1,024-element sum), two alternating (that and a 10-element sum) and a cycle of four with a
repeat (A, B, A, C: B an average of a 2x3 tensor, C a 3x5 sum), each after 50 untimed rounds.
"""

import time
from collections.abc import Callable

import torch
from mpi4py import MPI

from mpisolve.comm.ops import allreduce


def main() -> None:
    world = MPI.COMM_WORLD
    a, b, c, d = torch.ones(1024), torch.ones(10), torch.ones(2, 3), torch.ones(3, 5)

    def per_call(calls: Callable[[], object], per_round: int, rounds: int) -> float:
        for _ in range(50):
            calls()
        world.Barrier()
        start = time.perf_counter()
        for _ in range(rounds):
            calls()
        return world.allreduce((time.perf_counter() - start) / rounds / per_round * 1e6, MPI.MAX)

    one = per_call(lambda: allreduce(a, "sum"), 1, 1000)
    two = per_call(lambda: (allreduce(a, "sum"), allreduce(b, "sum")), 2, 500)
    four = per_call(
        lambda: (allreduce(a, "sum"), allreduce(c, "average"), allreduce(a, "sum"), allreduce(d, "sum")), 4, 250
    )
    if world.rank == 0:
        print(f"{world.size} ranks: one signature {one:.1f} us/call, two alternating {two:.1f}, A,B,A,C {four:.1f}")


if __name__ == "__main__":
    main()
