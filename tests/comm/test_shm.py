"""Node-shared sums on real ranks: exact against numpy, gradient buckets read in place, fallback, watchdog.

Also run on the emulated 2-node cluster (``make test-cluster``, marker ``cluster``), where
the same sums go hierarchically: the node's sum, then MPI between the nodes.
"""

import time

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpisolve
from mpisolve.comm import shm
from mpisolve.comm.buckets import GradientBuckets
from mpisolve.comm.communicator import Communicator, PersistentAllreduce
from mpisolve.comm.shm import LATENCY_MAX_BYTES, NodeAllreduce, node_group
from mpisolve.errors import CommTimeout

ALL_SIZES = pytest.mark.ranks(2, 3, 4, 5, 8)


def rank_input(rank: int, round_: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * round_ + rank)
    return (torch.randn(numel, generator=g) * 10).to(dtype)


def oracle(comm: Communicator, round_: int, numel: int, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """numpy-free reference: each node's ranks summed in local-rank order in float32/64, nodes added, scaled."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    ranks_of_node = comm.comm.allgather((comm.node.Get_rank(), comm.rank))
    nodes: dict[int, list[int]] = {}
    for local, world in sorted(ranks_of_node):
        nodes.setdefault(local, []).append(world)  # world ranks with local rank `local`, node by node
    by_node = list(zip(*nodes.values()))  # one tuple of world ranks per node, in local-rank order
    total = None
    for members in by_node:
        node_sum = rank_input(members[0], round_, numel, dtype).to(acc)
        for r in members[1:]:
            node_sum += rank_input(r, round_, numel, dtype).to(acc)
        total = node_sum if total is None else total + node_sum
    return (total * scale).to(dtype)


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@ALL_SIZES
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sums_equal_the_ordered_reference_round_after_round(dtype):
    comm = Communicator()
    group = node_group(comm)
    assert group is not None  # several ranks per node here
    itemsize = torch.empty(0, dtype=dtype).element_size()
    sizes = [1, 1000, LATENCY_MAX_BYTES // itemsize, LATENCY_MAX_BYTES // itemsize + 1, 70_001]
    # Every other op carries a float64 tally in its round: summed exactly and unscaled.
    ops = [NodeAllreduce(group, n, dtype, scale=0.5, tally=2 * (i % 2)) for i, n in enumerate(sizes)]
    assert [op.latency for op in ops] == [True, True, True, False, False]
    for round_ in range(3):
        for op in ops:
            op.wait_writable()
            op.input.copy_(rank_input(comm.rank, round_, op.numel, dtype))
            op.tally_input.copy_(
                torch.tensor([comm.rank + 1, 2.0**40 + round_], dtype=torch.float64)[: op.tally_input.numel()]
            )
            op.start()
        for op in ops[::-1]:  # completed in another order than started
            op.wait()
        for i, op in enumerate(ops):
            tally = [comm.size * (comm.size + 1) / 2, comm.size * (2.0**40 + round_)]
            assert op.tally_result.tolist() == tally[: 2 * (i % 2)]
            want = oracle(comm, round_, op.numel, dtype, 0.5)
            if comm.nodes == 1:  # one node: the kernel's order is the oracle's, bit for bit
                assert torch.equal(op.result, want), (op.numel, round_)
            else:  # MPI adds the nodes' sums in its own order
                torch.testing.assert_close(
                    op.result.float(), want.float(), rtol=1e-2 if itemsize == 2 else 1e-6, atol=1e-5
                )
    for op in ops:
        op.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@ALL_SIZES
def test_a_small_sum_crosses_between_nodes_once_per_node_from_its_leader(monkeypatch):
    """The latency path across nodes: local rank 0 alone sums the node's slots, exchanges the sum and
    the tally with the other nodes' local rank 0 and publishes them; the node's other ranks copy them
    (every rank of a node gets the same bits). On one node nothing crosses; the bandwidth path's ranks each cross."""
    comm = Communicator()
    group = node_group(comm)
    assert group is not None  # several ranks per node here
    started = []
    start = PersistentAllreduce.start

    def spy(self):
        started.append(self.comm)
        start(self)

    monkeypatch.setattr(PersistentAllreduce, "start", spy)
    small = NodeAllreduce(group, 100, torch.float32, scale=0.5, tally=2)
    large = NodeAllreduce(group, LATENCY_MAX_BYTES // 4 + 1, torch.float32)
    assert small.latency and not large.latency
    for round_ in range(3):
        small.input.copy_(rank_input(comm.rank, round_, small.numel, torch.float32))
        small.tally_input.copy_(torch.tensor([comm.rank + 1, 2.0**40 + round_], dtype=torch.float64))
        small.start()
        small.wait()
        want = oracle(comm, round_, small.numel, torch.float32, 0.5)
        torch.testing.assert_close(small.result, want, rtol=1e-6, atol=1e-5)
        assert small.tally_result.tolist() == [comm.size * (comm.size + 1) / 2, comm.size * (2.0**40 + round_)]
        every = comm.node.allgather(small.result.numpy().tobytes())
        assert all(bits == every[0] for bits in every)
    leader = comm.local_rank == 0
    assert started == ([group.cross] * 6 if comm.nodes > 1 and leader else []), (comm.local_rank, len(started))
    large.input.fill_(1.0)
    large.start()
    large.wait()
    assert torch.equal(large.result, torch.full((large.numel,), float(comm.size)))
    assert len(started) == ((6 if leader else 0) + 1 if comm.nodes > 1 else 0)
    for op in (small, large):
        op.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@pytest.mark.ranks(2, 4)
@pytest.mark.parametrize("numel", [10, LATENCY_MAX_BYTES // 4 + 1])  # the latency path and the bandwidth path
def test_a_sum_freed_mid_round_completes_the_round_first(numel):
    """MPI frees no started request, and the window's free is collective: a round started and freed
    without a wait is completed first, on every rank, then freed (across nodes its exchange is in flight)."""
    comm = Communicator()
    op = NodeAllreduce(node_group(comm), numel, torch.float32, tally=1)
    op.input.fill_(1.0)
    op.tally_input.fill_(1.0)
    op.start()
    op.free()
    assert op.win == MPI.WIN_NULL and op.stage == "idle"
    assert op.tally_result.tolist() == [float(comm.size)]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 40)
        self.b = nn.Linear(40, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def mean_grads(comm: Communicator, x: torch.Tensor, model: nn.Module) -> list[torch.Tensor]:
    """The oracle: every rank's gradients on its own input, computed here, averaged."""
    total = None
    for r in range(comm.size):
        model.zero_grad(set_to_none=True)
        model(x + r).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
    return [t / comm.size for t in total]


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@ALL_SIZES
@pytest.mark.parametrize("path", ["latency", "bandwidth", "mpi"])
def test_gradient_buckets_read_the_sum_in_place_and_accumulate_on_it(path, monkeypatch):
    """Bandwidth-path sums are read where they lie in the window (once a step showed that the
    optimizer leaves p.grad alone); latency-path and MPI's sums land in the buckets themselves, in place."""
    if path == "bandwidth":
        monkeypatch.setattr(shm, "LATENCY_MAX_BYTES", 0)
    node_shm = path != "mpi"
    comm = Communicator(node_shm=node_shm)
    torch.manual_seed(0)
    model, oracle_model = Net(), Net()
    oracle_model.load_state_dict(model.state_dict())
    x = torch.linspace(-1, 1, 12).view(4, 3)
    want = mean_grads(comm, x, oracle_model)
    grads = GradientBuckets(model.parameters(), comm, bucket_bytes=200, average=True)
    assert (grads.node is not None) == node_shm and len(grads.buckets) > 1
    # The first step: an optimizer that leaves p.grad alone (on this rank's own copy, as any first).
    grads.zero_()
    model(x + comm.rank).sum().backward()
    grads.finish()
    grads.stepped()
    grads.rearm()
    grads.zero_()
    model(x + comm.rank).sum().backward()
    grads.finish()
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=1e-5, atol=1e-6)
    for bucket in grads.buckets:
        for p, view in zip(bucket.params, bucket.result.views):
            assert p.grad.data_ptr() == view.data_ptr()  # read where the sum lies
        assert bucket.shared == (bucket.result is not bucket.buffer) == (path == "bandwidth")
    grads.rearm()
    # No zeroing: the next backward adds onto the averaged gradients, as on MPI's path.
    model(x + comm.rank).sum().backward()
    local = mean_grads(Communicator(comm.comm.Split(comm.rank)), x + comm.rank, oracle_model)
    grads.finish()
    for p, w, own in zip(model.parameters(), want, local):
        torch.testing.assert_close(p.grad, w + sum_of_means(comm, own), rtol=1e-5, atol=1e-5)
    grads.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("bandwidth", [False, True], ids=["latency", "bandwidth"])
def test_a_step_waits_for_the_nodes_ranks_only_where_its_sums_are_shared(bandwidth, monkeypatch):
    """Bandwidth-path sums are read in place by every local rank, so ``rearm`` (the step's end)
    waits until all have stepped: none zeroes a sum another still reads. Latency-path
    results are each rank's own memory: the step ends without that wait."""
    if bandwidth:
        monkeypatch.setattr(shm, "LATENCY_MAX_BYTES", 0)
    comm = Communicator()
    model = Net()
    grads = GradientBuckets(model.parameters(), comm, bucket_bytes=200, average=True)
    assert grads.node is not None and all(op.latency != bandwidth for op in grads.node.ops)
    for _ in range(2):
        grads.zero_()
        model(torch.ones(2, 3)).sum().backward()
        grads.finish()
        grads.rearm()
    assert grads.node._release._seq == (2 if bandwidth else 0)  # the node-wide waits at the steps' ends
    grads.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("path", ["latency", "bandwidth", "mpi", "mpi-as-on-a-device"])
def test_weighted_buckets_give_the_sample_weighted_mean_as_the_counts_change(path, monkeypatch):
    """lb-bsp's sum_r n_r g_r / sum_r n_r, against the same mean made here from every
    rank's gradients, over steps whose counts stay, change, and stay again. Each rank
    weighs by its count over the last step's global count: a step with the same count
    has the mean as summed, read in place in the window once the optimizer is seen not to
    write it (:meth:`stepped`); a changed count rescales the sum (node-shared: each rank's
    own copy). On the latency path the tally is summed in place, in the tensor this rank's
    sample count was written to; MPI's path weighs alike, its scale computed by the host
    or, as on a device, where the sums are (never read by the host)."""
    if path == "bandwidth":
        monkeypatch.setattr(shm, "LATENCY_MAX_BYTES", 0)
    comm = Communicator(node_shm=not path.startswith("mpi"))
    samples = [0]
    param = nn.Parameter(torch.zeros(50))
    grads = GradientBuckets([param], comm, bucket_bytes=1000, samples=lambda: samples[0], weighted=True)
    if path.startswith("mpi"):
        assert grads.node is None
        if path == "mpi-as-on-a-device":
            grads._summed_host = None
    else:
        assert grads.node is not None and grads.node.ops[0].latency == (path == "latency")
    mine = [torch.linspace(-1, 1, 50) * (r + 1) for r in range(comm.size)]
    # The first step's count differs from the 1 assumed before it, the third's from the second's.
    for step, factor in enumerate([1, 1, 2, 2, 2]):
        counts = [(3 + 2 * r) * factor for r in range(comm.size)]
        samples[0] = counts[comm.rank]
        want = sum(n * g for n, g in zip(counts, mine)) / sum(counts)
        grads.zero_()
        param.grad.copy_(mine[comm.rank])
        reduction = grads.finish()
        assert reduction.samples == sum(counts)
        torch.testing.assert_close(param.grad, want)
        in_window = param.grad.data_ptr() != grads.buckets[0].buffer.flat.data_ptr()
        # Own copies: the first step (rescaled), the second (unscaled: stepped() sees the optimizer
        # not write it), the third (rescaled); then the sums are read in place.
        assert in_window == (path == "bandwidth" and step >= 3), step
        grads.stepped()
        grads.rearm()
    if grads.node is not None:
        assert grads.node._release._seq == (5 if path == "bandwidth" else 0)  # the node-wide waits at the steps' ends
    grads.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)
def test_weighted_half_precision_buckets_keep_mpis_path_where_the_weighted_sum_would_overflow():
    """sum_r n_r g_r of 2 ranks x 512 samples x 100 is 102,400: past float16's 65,504. MPI's
    path weighs and sums in float32 and rounds once, after the division."""
    comm = Communicator()
    param = nn.Parameter(torch.zeros(8, dtype=torch.float16))
    grads = GradientBuckets([param], comm, bucket_bytes=1000, samples=lambda: 512, weighted=True)
    assert grads.node is None
    grads.zero_()
    param.grad.fill_(100.0)
    grads.finish()
    assert torch.equal(param.grad, torch.full((8,), 100.0, dtype=torch.float16))
    grads.close()


def sum_of_means(comm: Communicator, own: torch.Tensor) -> torch.Tensor:
    """The mean over ranks of each rank's ``own`` (rank r's input is x + r)."""
    return comm.allreduce_(own.clone()) / comm.size


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@ALL_SIZES
def test_allreduce_solver_with_and_without_node_memory_trains_alike():
    results = []
    for node_shm in (True, False):
        comm = Communicator(node_shm=node_shm)
        torch.manual_seed(3)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        solver = mpisolve.make_solver("allreduce", model, opt, comm=comm, bucket_mb=0.0002)
        g = torch.Generator().manual_seed(comm.rank)
        for _ in range(3):
            solver.zero_grad()
            model(torch.randn(5, 3, generator=g)).square().mean().backward()
            info = solver.step()
            assert info.applied and info.global_samples == 5 * comm.size
        results.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        solver.close()
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)
    gathered = Communicator().allgather_object(results[0].tolist())
    assert all(g == gathered[0] for g in gathered)  # every rank read the same sum


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@pytest.mark.ranks(2, 4)
def test_functional_allreduce_goes_through_the_node_windows():
    comm = Communicator()
    tensors = [torch.full((5, 3), float(comm.rank + 1)), torch.full((7,), 2.0 * comm.rank, dtype=torch.float64)]
    out = mpisolve.allreduce(tensors, op="average", comm=comm)
    ranks = comm.size
    assert torch.equal(out[0], torch.full((5, 3), (ranks + 1) / 2))
    assert torch.equal(out[1], torch.full((7,), float(ranks - 1), dtype=torch.float64))
    kept = list(node_group(comm).kept.by_key.values())
    assert len(kept) == 2  # a window per fused buffer, kept for the next call
    comm.free()  # and freed with the communicator
    assert all(op.win == MPI.WIN_NULL for op in kept)


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@pytest.mark.ranks(2, 4)
def test_a_rank_that_never_starts_trips_the_watchdog_and_the_round_still_completes():
    patient, comm = Communicator(), Communicator(timeout_s=0.5)
    op = NodeAllreduce(node_group(comm), 10, torch.float32)
    op.input.fill_(comm.rank)
    late = comm.local_rank == 0
    if not late:
        op.start()
        with pytest.raises(CommTimeout, match="node-shared allreduce.*arrived"):
            op.wait()
    patient.barrier()
    if late:
        op.start()
    op.wait()
    node_ranks = comm.node.allgather(comm.rank)
    want = float(sum(node_ranks)) if comm.nodes == 1 else float(sum(range(comm.size)))
    assert torch.equal(op.result, torch.full((10,), want))
    op.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 4)
def test_falls_back_when_off_or_alone_on_the_node():
    comm = Communicator()
    assert node_group(Communicator(node_shm=False)) is None
    alone = comm.split(comm.rank)
    assert alone is not None and node_group(alone) is None
    model = Net()
    grads = GradientBuckets(model.parameters(), alone, bucket_bytes=10**6)
    assert grads.node is None
    grads.close()


class WithEmpty(nn.Module):
    """Net and, registered last, a float64 parameter of no elements: the first bucket, holding
    nothing (on the node path the step's tally rides in its round)."""

    def __init__(self):
        super().__init__()
        self.net = Net()
        self.tail = nn.ParameterList([nn.Parameter(torch.empty(0, dtype=torch.float64))])

    def forward(self, x):
        return self.net(x) + self.tail[0].sum()


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("path", ["latency", "bandwidth", "mpi"])
def test_empty_tensors_and_buckets_on_every_path(path, monkeypatch):
    """Before the fix the node path refused them (``numel must be >= 1``); MPI's took them."""
    if path == "bandwidth":
        monkeypatch.setattr(shm, "LATENCY_MAX_BYTES", 0)
    comm = Communicator(node_shm=path != "mpi")
    for op, scale in (("sum", 1.0), ("average", 1.0 / comm.size), ("adasum", None)):
        (alone,) = mpisolve.allreduce([torch.empty(0)], op=op, comm=comm)
        empty, full = mpisolve.allreduce([torch.empty(0, 2), torch.full((3,), comm.rank + 1.0)], op=op, comm=comm)
        assert alone.shape == (0,) and empty.shape == (0, 2) and full.shape == (3,)
        if scale is not None:
            torch.testing.assert_close(full, torch.full((3,), scale * comm.size * (comm.size + 1) / 2))
    torch.manual_seed(0)
    model, oracle_model = WithEmpty(), Net()
    oracle_model.load_state_dict(model.net.state_dict())
    x = torch.linspace(-1, 1, 12).view(4, 3)
    grads = GradientBuckets(model.parameters(), comm, bucket_bytes=200, average=True)
    assert (grads.node is not None) == (path != "mpi")
    assert [p.numel() for p in grads.buckets[0].params] == [0]  # registered last: bucketed first, alone
    for _ in range(2):
        grads.zero_()
        model(x + comm.rank).sum().backward()
        grads.finish()
        for p, w in zip(model.net.parameters(), mean_grads(comm, x, oracle_model)):
            torch.testing.assert_close(p.grad, w, rtol=1e-5, atol=1e-6)
        assert model.tail[0].grad.shape == (0,)
        grads.stepped()
        grads.rearm()
    grads.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("choice, named", [("node_shm", "MPISOLVE_NODE_SHM"), ("stage_all", "MPISOLVE_STAGE")])
def test_ranks_that_choose_different_paths_are_told_at_construction(choice, named):
    """Before the fix each rank chose alone: one summed in node-shared memory, the other by MPI,
    and both waited until the watchdog with a message about a round that never came."""
    comm = Communicator(timeout_s=10, **{choice: MPI.COMM_WORLD.Get_rank() == 0})
    with pytest.raises(ValueError, match=f"the ranks disagree on .*{named}.*: on at rank\\(s\\) 0, off at the others"):
        GradientBuckets(Net().parameters(), comm, bucket_bytes=10**6, average=True)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)
@pytest.mark.parametrize("node_shm", [True, False])
def test_steps_whose_buckets_finish_starts_leave_nothing_in_flight(node_shm):
    """No backward, so ``finish`` starts every bucket and no hook's progress() drops them: the
    reducer must, or its list of rounds in flight grows by one every step."""
    comm = Communicator(node_shm=node_shm)
    param = nn.Parameter(torch.zeros(10))
    grads = GradientBuckets([param], comm, bucket_bytes=1000, average=True)
    assert (grads.node is not None) == node_shm
    for _ in range(3):
        param.grad.fill_(float(comm.rank))
        grads.finish()
        assert torch.equal(param.grad, torch.full((10,), (comm.size - 1) / 2))
        grads.rearm()
    assert len(grads.reducer._inflight) == 0  # type: ignore[attr-defined]
    grads.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)
@pytest.mark.parametrize("node_shm", [True, False])
def test_every_steps_reduction_counts_that_steps_samples(node_shm, monkeypatch):
    # Reductions are kept by tally: one seen before is reused, a new one made, and a step
    # whose count is new (more kinds than are kept) still gets its own count; in the steps
    # marked, the last rank withholds (it counts neither its samples nor itself).
    monkeypatch.setattr("mpisolve.comm.buckets.MAX_KEPT_REDUCTIONS", 4)
    comm = Communicator(node_shm=node_shm)
    param = nn.Parameter(torch.zeros(10))
    counts = [3, 5, 3, 7, 8, 9, 11, 3, 5, 3]
    withheld = {3, 9}
    grads = GradientBuckets([param], comm, bucket_bytes=1000, samples=lambda: counts[step] * (comm.rank + 1))
    seen = []
    for step in range(len(counts)):
        if step in withheld and comm.rank == comm.size - 1:
            grads.withhold()
        reduction = grads.finish()
        ranks = comm.size - 1 if step in withheld else comm.size
        assert (reduction.samples, reduction.ranks) == (counts[step] * ranks * (ranks + 1) // 2, ranks)
        seen.append(reduction)
        grads.rearm()
    assert seen[2] is seen[0] and len(grads._reductions) <= 4
    grads.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
@pytest.mark.parametrize("node_shm", [True, False])
@pytest.mark.parametrize("numel", [10, LATENCY_MAX_BYTES // 4 + 1])  # node-shared: the latency path, a shared sum
def test_the_average_is_over_the_ranks_that_contributed(node_shm, numel):
    # Every rank, the last withholding, every rank withholding, every rank again: the mean of the
    # contributing ranks' values (none contributing: zeros), and their count.
    comm = Communicator(node_shm=node_shm)
    param = nn.Parameter(torch.zeros(numel))
    grads = GradientBuckets([param], comm, bucket_bytes=4 * numel, average=True)
    assert (grads.node is not None) == node_shm
    assert not node_shm or grads.buckets[0].shared == (numel > 10)
    values = [float(rank + 1) for rank in range(comm.size)]
    for withholding in ([], [comm.size - 1], list(range(comm.size)), []):
        if comm.rank in withholding:
            grads.withhold()
        else:
            param.grad.fill_(values[comm.rank])
        reduction = grads.finish()
        contributing = [v for rank, v in enumerate(values) if rank not in withholding]
        assert reduction.ranks == len(contributing)
        mean = sum(contributing) / len(contributing) if contributing else 0.0
        assert torch.allclose(param.grad, torch.full((numel,), mean), rtol=1e-6, atol=0), (withholding, param.grad)
        grads.rearm()
    grads.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_a_latency_round_is_not_overwritten_by_ranks_that_run_ahead():
    """Local rank 0 arrives first and sums late; the others complete each round as soon as
    it has arrived and start the next at once, writing their inputs for it while rank 0
    still has the last round's slots to read. Each round's sum must be that round's."""
    comm = Communicator()
    op = NodeAllreduce(node_group(comm), 1000, torch.float32)
    assert op.latency
    summed = comm.node.allgather(comm.rank) if comm.nodes == 1 else range(comm.size)
    for round_ in range(4):  # nothing in the loop synchronises the ranks but the rounds themselves
        mine = torch.full((1000,), float(100 * round_ + comm.rank))
        op.input.copy_(mine)
        if comm.local_rank == 0:
            op.start()
            time.sleep(0.02)  # the others finish this round and start writing the next meanwhile
        else:
            time.sleep(0.002)  # rank 0 arrives first
            op.start()
        op.wait()
        want = sum(100.0 * round_ + r for r in summed)
        assert torch.equal(op.input, torch.full((1000,), want)), round_
    op.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@pytest.mark.ranks(2, 4)
def test_node_shared_sums_across_nodes_keep_their_exchange_moving(monkeypatch):
    """Every wait for a node-shared sum with an exchange between nodes asks for one that never
    sleeps (:meth:`Communicator.wait_for`'s ``transfers``); on one node none has one. (Other
    waits, for a node's own ranks or a setup's collectives, keep the usual polling.)"""
    comm = Communicator()
    asked = []
    wait_for = Communicator.wait_for

    def spy(self, done, what, **kwargs):
        named = what() if callable(what) else what
        if named.startswith(("node-shared allreduce (", "kept sum")):
            asked.append((named, kwargs.get("transfers", False)))
        return wait_for(self, done, what, **kwargs)

    monkeypatch.setattr(Communicator, "wait_for", spy)
    group = node_group(comm)
    for numel in (10, LATENCY_MAX_BYTES):  # the latency path and the bandwidth path
        op = NodeAllreduce(group, numel, torch.float32)
        op.input.fill_(1.0)
        op.start()
        op.wait()
        tensor = torch.ones(numel)
        persistent = shm.NodePersistentAllreduce(group, tensor)
        persistent.start()
        persistent.wait()
        assert torch.equal(tensor, torch.full((numel,), float(comm.size)))
        kept = shm.kept_sums(comm, [(numel, torch.float32, torch.device("cpu"))])
        kept[0].input.fill_(2.0)
        shm.sum_kept(comm, kept, "kept sum")
        for one in (op, persistent):
            one.free()
    # Six waits across nodes (a rank that exchanges polls until its exchange is posted, then waits in MPI);
    # on one node a round already complete at its wait's first poll asks for none.
    assert len(asked) >= (6 if comm.nodes > 1 else 1) and all(flag == (comm.nodes > 1) for _, flag in asked), asked
