"""Device buffers and MPI on real ranks: the staged path against the direct one.

Without a GPU, a communicator that stages every tensor (CPU ones too) runs each
collective through host twins; its results must equal the direct path's bit for bit.
The tests marked ``gpu`` do the same with CUDA tensors, staged and (where the MPI
library is CUDA-aware) direct, against CPU results.
"""

import pytest
import torch

from mpisolve.comm.buckets import GradientBuckets
from mpisolve.comm.collectives import allreduce
from mpisolve.comm.communicator import Communicator, init
from mpisolve.comm.device import detect_cuda_aware


class StagingEverything(Communicator):
    """A real communicator whose every tensor reaches MPI through its own host twin."""

    def needs_staging(self, tensor: torch.Tensor) -> bool:
        return True


def _rank_data(comm, *shape, dtype=torch.float32, device="cpu", rank=None):
    g = torch.Generator().manual_seed(1000 + (comm.rank if rank is None else rank))
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_staged_allreduce_and_bcast_equal_direct():
    direct, staged = Communicator(), StagingEverything()
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
    comm = StagingEverything()
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
    direct, staged = Communicator(), StagingEverything()
    tensors = [_rank_data(direct, 4, 4), _rank_data(direct, 1), _rank_data(direct, 3, dtype=torch.float16)]
    expected = allreduce(tensors, op="average", comm=direct)
    got = allreduce(tensors, op="average", comm=staged)
    assert all(torch.equal(e, g) and e.dtype == g.dtype for e, g in zip(expected, got))


def _model_grads(comm, device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(device, dtype)
    grads = GradientBuckets(
        model.parameters(), comm, bucket_bytes=100, samples=lambda: 4 + comm.rank, scale=1.0 / comm.size
    )
    grads.zero_()
    model(_rank_data(comm, 4 + comm.rank, 6, dtype=dtype, device=device)).square().sum().backward()
    samples = grads.finish()
    out = [p.grad.detach().cpu().clone() for p in model.parameters()], samples, len(grads.buckets)
    grads.close()
    return out


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_staged_gradient_buckets_equal_direct():
    direct_grads, direct_samples, buckets = _model_grads(Communicator())
    staged_grads, staged_samples, _ = _model_grads(StagingEverything())
    assert buckets > 1
    assert direct_samples == staged_samples == sum(4 + r for r in range(Communicator().size))
    assert all(torch.equal(d, s) for d, s in zip(direct_grads, staged_grads))


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
    cpu, gpu = Communicator(), Communicator(cuda_aware=aware)
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
