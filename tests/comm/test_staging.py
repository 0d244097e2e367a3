"""Device buffers and MPI on real ranks: the staged path against the direct one.

Without a GPU, a communicator that stages every tensor (``stage_all``, CPU ones too)
runs every MPI operation through host twins, on every communicator split from it; its
results must equal the direct path's bit for bit (the same operations in the same order
on the same values). The tests marked ``gpu`` do the same with CUDA tensors, staged and
(where the MPI library is CUDA-aware) direct, against CPU results. The direct path is
MPI's own (``node_shm=False``): node-shared sums take only tensors MPI is given directly,
so a staged communicator never uses them, and they add in their own order.
"""

import pytest
import torch
from mpi4py import MPI

import mpisolve
from mpisolve.comm.buckets import GradientBuckets, Unreduced
from mpisolve.comm.collectives import _start_sum, allreduce
from mpisolve.comm.communicator import Communicator, PersistentAllreduce, Posting, as_communicator, init
from mpisolve.comm.device import STAGE_ENV, Stager, detect_cuda_aware


def _rank_data(comm, *shape, dtype=torch.float32, device="cpu", rank=None):
    g = torch.Generator().manual_seed(1000 + (comm.rank if rank is None else rank))
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_staged_allreduce_and_bcast_equal_direct():
    direct, staged = Communicator(node_shm=False), Communicator(stage_all=True)
    for dtype in (torch.float32, torch.float64):
        a, b = _rank_data(direct, 5, 3, dtype=dtype), _rank_data(direct, 5, 3, dtype=dtype)
        direct.allreduce_(a)
        staged.allreduce_(b)
        assert torch.equal(a, b)
    a, b = _rank_data(direct, 7, dtype=torch.bfloat16), _rank_data(direct, 7, dtype=torch.bfloat16)
    direct.bcast_(a, root=1)
    staged.bcast_(b, root=1)
    assert torch.equal(a, b)
    assert torch.equal(b, _rank_data(direct, 7, dtype=torch.bfloat16, rank=1))


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_staged_persistent_allreduce_reuses_its_host_buffer():
    comm = Communicator(stage_all=True)
    t = torch.zeros(9)
    req = comm.persistent_allreduce(t)
    host = req.stager.host
    assert host is not None and host.data_ptr() != t.data_ptr()
    for i in range(3):
        t.fill_(comm.rank + i)
        req.start()
        req.wait()
        assert t.tolist() == [sum(range(comm.size)) + i * comm.size] * 9
        assert req.stager.host is host
    req.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_staged_functional_allreduce_equals_direct():
    direct, staged = Communicator(node_shm=False), Communicator(stage_all=True)
    tensors = [_rank_data(direct, 4, 4), _rank_data(direct, 1), _rank_data(direct, 3, dtype=torch.float16)]
    expected = allreduce(tensors, op="average", comm=direct)
    got = allreduce(tensors, op="average", comm=staged)
    assert all(torch.equal(e, g) and e.dtype == g.dtype for e, g in zip(expected, got))


def _model_grads(comm, device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(device, dtype)
    grads = GradientBuckets(model.parameters(), comm, bucket_bytes=100, samples=lambda: 4 + comm.rank, average=True)
    grads.zero_()
    model(_rank_data(comm, 4 + comm.rank, 6, dtype=dtype, device=device)).square().sum().backward()
    samples = grads.finish().samples
    out = [p.grad.detach().cpu().clone() for p in model.parameters()], samples, len(grads.buckets)
    grads.close()
    return out


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_staged_gradient_buckets_equal_direct():
    direct_grads, direct_samples, buckets = _model_grads(Communicator(node_shm=False))
    staged_grads, staged_samples, _ = _model_grads(Communicator(stage_all=True))
    assert buckets > 1
    assert direct_samples == staged_samples == sum(4 + r for r in range(Communicator().size))
    assert all(torch.equal(d, s) for d, s in zip(direct_grads, staged_grads))


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_forced_staging_reaches_every_communicator_the_library_makes(monkeypatch):
    staged = Communicator(stage_all=True)
    sub = staged.dup()
    assert staged.stage_all and sub.stage_all and sub.needs_staging(torch.zeros(1))
    assert staged.stager(torch.zeros(3)).host is not None
    monkeypatch.setenv(STAGE_ENV, "1")  # what a user sets to run the staged path without a GPU
    assert Communicator().stage_all
    world_split = MPI.COMM_WORLD.Split(0)
    try:
        assert as_communicator(world_split).stage_all  # mpisolve.allreduce(..., comm=<mpi4py comm>)
    finally:
        world_split.Free()
    monkeypatch.setenv(STAGE_ENV, "yes")
    with pytest.raises(ValueError, match="MPISOLVE_STAGE must be 0 or 1, got 'yes'"):
        Communicator(MPI.COMM_SELF)


def _rank_model(rank_seed: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return model, torch.Generator().manual_seed(rank_seed)


def _adasum_solver_params(comm, mode):
    model, gen = _rank_model(7 + comm.rank)
    solver = mpisolve.make_solver("adasum", model, torch.optim.SGD(model.parameters(), lr=0.1), comm, mode=mode)
    for _ in range(3):
        solver.zero_grad()
        model(torch.randn(5, 6, generator=gen)).square().sum().backward()
        solver.step()
    solver.close()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_staged_adasum_equals_direct():
    # The issue's finding: Adasum's messages bypassed the stager and its statistics'
    # allreduce was completed without copying the staged sums back, so forcing staging
    # changed the 2-rank result by about 0.1. Every message now goes through a stager.
    direct, staged = Communicator(node_shm=False), Communicator(stage_all=True)
    tensors = [_rank_data(direct, *shape) for shape in [(3, 4), (7,), (257,), (10, 10)]]
    tensors.append(_rank_data(direct, 5, dtype=torch.float64))
    expected = allreduce(tensors, op="adasum", comm=direct)
    got = allreduce(tensors, op="adasum", comm=staged)
    assert all(torch.equal(e, g) for e, g in zip(expected, got))
    for mode in ("delta", "gradient"):
        direct_params = _adasum_solver_params(direct, mode)
        staged_params = _adasum_solver_params(staged, mode)
        assert all(torch.equal(d, s) for d, s in zip(direct_params, staged_params)), mode


class LateStager(Stager):
    """A stager whose data becomes ready only after ``late`` polls, as a CUDA event passes when its kernels end."""

    def __init__(self, tensor, late):
        super().__init__(tensor)
        self.always_ready = False  # host memory, made to wait as device data does
        self.late = late
        self.polls = 0

    def to_mpi(self, values=True):
        super().to_mpi(values)
        self.polls = 0

    def ready(self):
        self.polls += 1
        return self.polls > self.late


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_operations_whose_data_is_late_are_posted_in_start_order():
    # Two nonblocking allreduces (mpisolve.allreduce's, one per fused buffer) match in the
    # order they are posted. Rank 0's first buffer is late, the other ranks' second:
    # posted as soon as each is ready, they would match the wrong buffers. Started in
    # order, each sums its own, and starting never blocks.
    comm = Communicator()
    first, second = torch.zeros(4), torch.zeros(4)
    for step in range(2):
        first.fill_(1.0 + comm.rank + step)
        second.fill_(100.0 * (1 + comm.rank))
        lates = [5, 0] if comm.rank == 0 else [0, 5]
        stagers = [LateStager(t, late) for t, late in zip((first, second), lates)]
        postings = [_start_sum(comm, stager) for stager in stagers]
        assert [p.posted for p in postings] == ([False, False] if comm.rank == 0 else [True, False])
        comm.wait_posted(postings, "late allreduces")
        assert first.tolist() == [sum(1.0 + r + step for r in range(comm.size))] * 4
        assert second.tolist() == [sum(100.0 * (1 + r) for r in range(comm.size))] * 4


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_a_persistent_collective_started_late_is_posted_by_its_wait():
    comm = Communicator()
    t = torch.zeros(3)
    reduction = PersistentAllreduce(comm, t)
    reduction.stager = LateStager(t, 3)
    reduction.posting = Posting([reduction.stager], reduction._post_start)
    t.fill_(comm.rank + 1.0)
    reduction.start()
    assert not reduction.posting.posted and not reduction.test()
    reduction.wait()
    assert t.tolist() == [comm.size * (comm.size + 1) / 2] * 3
    reduction.free()


def test_one_ranks_persistent_collectives_call_no_mpi_and_stage_nothing():
    # Over one rank an in-place sum or broadcast leaves the buffer as it is: no request is
    # made or posted, no host twin taken (a GPU model's steps copy nothing to the host);
    # forced staging (the staged path's test double) keeps the whole path.
    t, alone = torch.arange(4.0), Communicator(MPI.COMM_SELF, stage_all=False)
    for req in (PersistentAllreduce(alone, t), alone.persistent_bcast(t)):
        assert req.alone and req._persistent is None and req.stager.host is None
        for _ in range(2):
            req.start()
            assert req.test()
            req.wait()
            assert req.posting.request == MPI.REQUEST_NULL and t.tolist() == [0.0, 1.0, 2.0, 3.0]
        req.free()
    staged = PersistentAllreduce(Communicator(MPI.COMM_SELF, stage_all=True), t)
    assert not staged.alone and staged.stager.host is not None
    staged.start()
    staged.wait()
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    staged.free()
    with pytest.raises(ValueError, match="root must be a rank of the communicator"):
        alone.persistent_bcast(t, root=1)


@pytest.mark.gpu
def test_one_ranks_gpu_buckets_are_not_staged():
    comm = Communicator(MPI.COMM_SELF, cuda_aware=False, stage_all=False)
    model = torch.nn.Linear(5, 3).cuda()
    grads = GradientBuckets(model.parameters(), comm, bucket_bytes=1 << 20, samples=lambda: 4)
    model(torch.ones(4, 5, device="cuda")).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    assert grads.finish().samples == 4
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
    assert grads.alone and isinstance(grads.reducer, Unreduced)  # nothing reduced, so nothing staged
    grads.close()


# ------------------------------------------------------------------ real GPU
@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)
def test_init_picks_the_local_gpu():
    comm = init()
    assert comm.device == torch.device("cuda", comm.local_rank % torch.cuda.device_count())
    assert torch.cuda.current_device() == comm.device.index


def _cuda_paths():
    paths = [False]
    if detect_cuda_aware()[0]:
        paths.append(True)
    return paths


@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)
@pytest.mark.parametrize("aware", [False, True], ids=["staged", "direct"])
def test_cuda_tensors_reduce_like_cpu_ones(aware):
    if aware not in _cuda_paths():
        pytest.skip("the MPI library is not CUDA-aware")
    cpu, gpu = Communicator(node_shm=False), Communicator(cuda_aware=aware)
    assert gpu.needs_staging(torch.zeros(1, device="cuda")) is not aware
    a = _rank_data(cpu, 1000)
    b = a.cuda() * 1  # produced by a kernel on the current stream just before MPI
    cpu.allreduce_(a)
    gpu.allreduce_(b)
    assert torch.equal(a, b.cpu())
    t = torch.zeros(5, device="cuda")
    req = gpu.persistent_allreduce(t)
    for i in range(2):
        t.fill_(gpu.rank + i)
        req.start()
        req.wait()
        assert t.cpu().tolist() == [sum(range(gpu.size)) + i * gpu.size] * 5
    req.free()
    out = allreduce([b, b[:3].double()], op="sum", comm=gpu)
    assert out[0].is_cuda and out[1].dtype == torch.float64
    cpu_grads, cpu_samples, _ = _model_grads(cpu)
    gpu_grads, gpu_samples, _ = _model_grads(gpu, device="cuda")
    assert cpu_samples == gpu_samples
    assert all(torch.allclose(c, g, rtol=1e-5, atol=1e-6) for c, g in zip(cpu_grads, gpu_grads))
