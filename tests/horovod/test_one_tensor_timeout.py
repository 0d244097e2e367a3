"""A one-tensor allreduce that times out leaves its MPI request or node-shared round started:
later calls on that communicator raise a clear :class:`CommTimeout` naming it (never an MPI
error, a reused buffer or a hang) until the call has completed alike on every rank, and then
go on. The late ranks complete it while the rank that timed out does other work (a node-shared
round then moves by a thread of that rank's).

Each case is a job of its own (``mpiexec``, bounded), where rank 0 times out while the other
ranks sleep past its timeout; sums are checked against numpy's sum of every rank's input.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

JOB = """
import sys, time
import numpy as np
import torch
from mpi4py import MPI
import mpisolve.horovod as hvd
from mpisolve.comm.onetensor import one_tensor
from mpisolve.errors import CommTimeout

case, path, numel = sys.argv[1], sys.argv[2], int(sys.argv[3])
hvd.init()
rank, size = hvd.rank(), hvd.size()
world = hvd.global_process_set.comm
one = one_tensor(world)
one.node_min_bytes = sys.maxsize if path == "mpi" else 0  # an MPI message, or a node-shared round
assert path == "mpi" or one.group is not None


def mine(step, numel=numel):
    return torch.arange(numel, dtype=torch.float32) + 10 * rank + 100 * step


def total(step, numel=numel):
    return sum(np.arange(numel, dtype=np.float32) + 10 * r + 100 * step for r in range(size))


def timeouts(seconds):
    for comm in (world, one.sums):
        comm.timeout_s = seconds


def in_step_again(step):
    # The calls after the one that timed out: along the cycle (rank 0 stepped past it as the others did:
    # else its message would be another than theirs), B, A, B, each a hit (rank 0 also steps past the call
    # that timed out, in the first); else A once more.
    if case != "cycle":
        np.testing.assert_array_equal(hvd.allreduce(mine(step), op=hvd.Sum).numpy(), total(step))
        return
    made = one._made
    for n in (numel + 2, numel, numel + 2):
        np.testing.assert_array_equal(hvd.allreduce(mine(step, n), op=hvd.Sum).numpy(), total(step, n))
    assert len(one._cycle) == 2 and one._made == made + 3 + (rank == 0), (one._cycle, one._made, made)


def refused(call, says):
    try:
        call()
    except CommTimeout as err:
        assert says in str(err), err
    else:
        raise AssertionError("no CommTimeout")


np.testing.assert_array_equal(hvd.allreduce(mine(0), op=hvd.Sum).numpy(), total(0))  # agreed, inline
if case == "cycle":  # calls alternate with another signature until the ranks go round both: A, B, A, B, A, B
    for step in range(5):
        n = numel + 2 if step % 2 == 0 else numel
        np.testing.assert_array_equal(hvd.allreduce(mine(step, n), op=hvd.Sum).numpy(), total(step, n))
    assert len(one._cycle) == 2  # the next call expected: A, the one to time out
timeouts(1.5)
if rank == 0:
    if case == "join":
        refused(hvd.join, "did not complete within 1.5 s")
    else:
        refused(lambda: hvd.allreduce(mine(1), op=hvd.Sum), "did not complete within 1.5 s")
    # the others are asleep: refused, nothing started
    refused(lambda: hvd.allreduce(mine(2), op=hvd.Sum), "timed out here earlier and is still in flight")
    if case == "free":  # at once, while the others sleep: the call that timed out is completed first
        assert one.stuck is not None
        timeouts(60.0)
        world.free()  # its message freed with the others, on every rank alike
        assert not one.entries.by_key
    MPI.COMM_WORLD.Barrier()  # MPI moves the started call along meanwhile: the others' late calls complete
    if case in ("late", "cycle"):
        timeouts(60.0)
        in_step_again(3)
    elif case != "free":
        refused(lambda: hvd.allreduce(mine(3), op=hvd.Sum), "timed out here earlier and completed out of step")
else:
    time.sleep(5.0)
    if case in ("late", "cycle", "free"):  # the call rank 0 timed out in, met late: rank 0's values are in it
        np.testing.assert_array_equal(hvd.allreduce(mine(1), op=hvd.Sum).numpy(), total(1))
    elif case == "other":  # another signature: the ranks negotiate, and rank 0 never comes
        refused(lambda: hvd.allreduce(mine(1, numel=3), op=hvd.Sum), "did not complete within 1.5 s")
    else:
        hvd.join()
    if case == "free":
        timeouts(60.0)
        world.free()
    MPI.COMM_WORLD.Barrier()
    if case in ("late", "cycle"):
        timeouts(60.0)
        in_step_again(3)
print(f"ok {rank}", flush=True)
"""


CASES = [("late", 2), ("late", 3), ("other", 2), ("join", 2)]
MPI_CASES = [("mpi", case, ranks, 5) for case, ranks in [*CASES, ("cycle", 2)]]
#: The node-shared round of 20,000 elements: the bandwidth path, where each rank sums a share.
NODE_CASES = [("node", case, ranks, 20_000) for case, ranks in [*CASES, ("cycle", 2), ("free", 2)]]
#: Across the emulated cluster's two nodes, rank 0 its node's leader (its exchange between the nodes).
CLUSTER_CASES = [("node-2x2", "late", 4, 5), ("node-2x2", "join", 4, 5)]
FAKE_SSH = Path(__file__).parents[1] / "cluster" / "fake-ssh"


@pytest.mark.parametrize(("path", "case", "ranks", "numel"), MPI_CASES + NODE_CASES + CLUSTER_CASES)
def test_a_timed_out_one_tensor_call_refuses_later_calls_clearly_until_it_completed_in_step(
    tmp_path, path, case, ranks, numel
):
    """late: the others meet the call later, and the next call sums right; cycle: the same along a learned
    cycle of two signatures, which every rank goes on round; free: rank 0 frees the communicator at once,
    which completes when the others meet the call late (rank 0 sums its share of a node-shared round);
    other: they meet it with another signature, so rank 0 stays refused; join: rank 0's join timed out, the
    others join later. Whether the message is MPI's or a node-shared round, on one node or two."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    mpiexec = Path(sys.executable).parent / "mpiexec"
    # polled waits, which raise CommTimeout: where ranks yield their cores, one tensor's wait is
    # MPI_Wait under the watchdog, which aborts the job instead
    env = dict(os.environ, MPIEXEC_TIMEOUT="150", MPISOLVE_TIMEOUT="60", MPISOLVE_WAIT="spin")
    hosts = ["-launcher", "ssh", "-launcher-exec", str(FAKE_SSH), "-hosts", "a:2,b:2"] if path == "node-2x2" else []
    job = subprocess.run(
        [str(mpiexec), *hosts, "-n", str(ranks), sys.executable, "-m", "mpi4py", str(script), case, path, str(numel)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert job.returncode == 0, job.stdout + job.stderr
    # mpiexec may run the ranks' lines together
    assert sorted(int(r) for r in re.findall(r"ok (\d+)", job.stdout)) == list(range(ranks)), job.stdout
