"""Where one `mpisolve.allreduce` of a small tensor spends its time, part by part, against MPICH's call.

Run on every rank (`mpiexec ... python call_parts.py [numel] [op]`): times, 3,000 calls each after 200
untimed, three rounds in turn, the slowest rank's mean per call in microseconds:

- `mpi`: MPICH's blocking `MPI_Allreduce` of the same bytes (send to receive buffer, as `bench sweep`);
- `full`: `mpisolve.allreduce(t, op)` (the call as users make it);
- `direct`: `OneTensor.allreduce` (without the module function's dispatch: the communicator, its state);
- `send_result`: the agreed message sent and waited for, then the result made (`_send`, `_result`);
- `send`: the message sent and waited for alone (copy in, flag, start, wait);
- `round`: the node-shared round alone (`NodeAllreduce.start` and `wait`; none where the message is MPI's).
"""

import sys
import time

import numpy as np
import torch
from mpi4py import MPI

from mpisolve.comm.communicator import as_communicator
from mpisolve.comm.onetensor import NodeMessage, one_tensor
from mpisolve.comm.ops import allreduce

CALLS, WARMUP, ROUNDS = 3000, 200, 3


def main() -> None:
    world = MPI.COMM_WORLD
    numel = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    op = sys.argv[2] if len(sys.argv) > 2 else "sum"
    tensor = torch.ones(numel)
    send, receive = np.ones(numel, dtype=np.float32), np.empty(numel, dtype=np.float32)
    comm = as_communicator(world)
    one = one_tensor(comm)
    allreduce(tensor, op)  # agrees the signature
    hit = one.message
    assert hit is not None

    def timed(call) -> float:
        for _ in range(WARMUP):
            call()
        world.Barrier()
        start = time.perf_counter()
        for _ in range(CALLS):
            call()
        return world.allreduce((time.perf_counter() - start) / CALLS * 1e6, MPI.MAX)

    def send_result() -> None:
        one._send(hit, tensor, 1.0)
        one._result(hit, op, 1.0)

    parts = {
        "mpi": lambda: world.Allreduce(send, receive, MPI.SUM),
        "full": lambda: allreduce(tensor, op),
        "direct": lambda: one.allreduce(tensor, op),
        "send_result": send_result,
        "send": lambda: one._send(hit, tensor, 1.0),
    }
    if isinstance(hit, NodeMessage):
        node_sum = hit.node_sum
        parts["round"] = lambda: (node_sum.start(), node_sum.wait("round"))
    times: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(ROUNDS):
        for name, call in parts.items():
            times[name].append(timed(call))
    if world.rank == 0:
        shown = ", ".join(f"{name} {' '.join(f'{t:.2f}' for t in ts)}" for name, ts in times.items())
        print(f"{world.size} ranks, {numel} float32, {op}, {type(hit).__name__}: {shown}")


if __name__ == "__main__":
    main()
