"""CUDA-awareness detection, the host stager and device choice (single process; the gpu-marked test needs a GPU)."""

import time

import pytest
import torch

from mpisolve.comm.communicator import mpi_buffer
from mpisolve.comm.device import (
    CUDA_AWARE_ENV,
    Stager,
    detect_cuda_aware,
    local_device,
    query_cuda_support,
    vendor_switch,
)


def test_option_beats_environment_beats_library(monkeypatch):
    monkeypatch.setenv(CUDA_AWARE_ENV, "1")
    assert detect_cuda_aware(False) == (False, "option cuda_aware=False")
    assert detect_cuda_aware() == (True, "MPISOLVE_CUDA_AWARE=1")
    monkeypatch.setenv(CUDA_AWARE_ENV, "0")
    assert detect_cuda_aware() == (False, "MPISOLVE_CUDA_AWARE=0")
    monkeypatch.setenv(CUDA_AWARE_ENV, "auto")
    aware, source = detect_cuda_aware()
    queried = query_cuda_support()
    if queried is not None:  # MPICH >= 4 and Open MPI answer at run time
        assert (aware, source) == (queried, f"MPIX_Query_cuda_support() = {int(queried)}")


def test_bad_settings_are_named(monkeypatch):
    with pytest.raises(TypeError, match="cuda_aware must be True, False or None, got '1'"):
        detect_cuda_aware("1")
    monkeypatch.setenv(CUDA_AWARE_ENV, "yes")
    with pytest.raises(ValueError, match="MPISOLVE_CUDA_AWARE must be 0, 1 or auto, got 'yes'"):
        detect_cuda_aware()


def test_vendor_switches_in_order():
    assert vendor_switch({}) is None
    assert vendor_switch({"MPICH_GPU_SUPPORT_ENABLED": "1"}) == (True, "MPICH_GPU_SUPPORT_ENABLED=1")
    assert vendor_switch({"MV2_USE_CUDA": "0", "MPIR_CVAR_ENABLE_GPU": "1"}) == (False, "MV2_USE_CUDA=0")
    assert vendor_switch({"MPIR_CVAR_ENABLE_GPU": "1"}) == (True, "MPIR_CVAR_ENABLE_GPU=1")
    assert vendor_switch({"MV2_USE_CUDA": "maybe"}) is None


def test_no_gpu_means_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert local_device(3) == torch.device("cpu")


def test_direct_stager_hands_mpi_the_tensor_itself():
    t = torch.arange(4.0)
    stager = Stager(t)
    assert stager.memory is t
    stager.to_mpi()
    stager.from_mpi()
    assert mpi_buffer(stager.memory)[0].ctypes.data == t.data_ptr()


def test_staged_stager_copies_through_its_own_host_buffer():
    t = torch.arange(6.0).view(2, 3)
    stager = Stager.staged(t)
    assert stager.memory is stager.host and stager.host.data_ptr() != t.data_ptr()
    stager.to_mpi()
    assert torch.equal(stager.host, t)
    stager.host.mul_(10)  # what MPI would leave there
    stager.from_mpi()
    assert torch.equal(t, torch.arange(6.0).view(2, 3) * 10)
    buffer_before = stager.host.data_ptr()
    stager.to_mpi()
    assert stager.host.data_ptr() == buffer_before  # reused, not reallocated


def test_a_receive_copies_nothing_to_the_host_buffer():
    t = torch.arange(3.0)
    stager = Stager.staged(t)
    stager.host.fill_(-1.0)
    stager.to_mpi(values=False)  # MPI will only write the host buffer
    assert stager.ready() and stager.host.tolist() == [-1.0] * 3
    stager.host.fill_(5.0)
    stager.from_mpi()
    assert t.tolist() == [5.0] * 3


def test_stager_refuses_what_mpi_cannot_take():
    with pytest.raises(ValueError, match="contiguous"):
        Stager(torch.zeros(3, 3).t())
    with pytest.raises(ValueError, match="CPU and CUDA tensors.*not meta"):
        Stager(torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match="staging buffer must be a CPU tensor of the tensor's shape and dtype"):
        Stager(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="CPU or CUDA tensor"):
        mpi_buffer(torch.zeros(3, device="meta"))


@pytest.mark.gpu
@pytest.mark.parametrize("staged", [True, False], ids=["staged", "direct"])
def test_stager_waits_for_the_kernels_without_blocking_the_host(staged):
    source = torch.arange(1000.0, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # a long kernel (about 0.1 s), then the values MPI is to send
        t = source * 2
        stager = Stager.staged(t) if staged else Stager(t)
        started = time.perf_counter()
        stager.to_mpi()
        queued_in = time.perf_counter() - started
        assert not stager.ready()  # the kernels that write t are still queued
    while not stager.ready():
        time.sleep(1e-3)
    assert torch.equal(stager.memory.cpu(), torch.arange(1000.0) * 2)
    assert queued_in < 0.05, f"to_mpi blocked the host for {queued_in:.3f} s"
    if staged:
        stager.host.fill_(1.0)  # what MPI would leave there
        with torch.cuda.stream(stream):
            stager.from_mpi()
            stager.to_mpi()  # the next use waits for the copy back before overwriting the host buffer
        while not stager.ready():
            time.sleep(1e-3)
        assert torch.equal(t.cpu(), torch.ones(1000))
