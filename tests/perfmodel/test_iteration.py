"""Each solver's iteration model on hand-worked values."""

import pytest

from mpisolve.errors import InputError, OptionError
from mpisolve.perfmodel.iteration import Case, Compute, iteration, model_options
from mpisolve.perfmodel.network import Network, adasum_allreduce, ring_allreduce
from mpisolve.perfmodel.workloads import Layer, Workload, workload

NET = Network(alpha=2e-6, beta=1e-9)
LOAD = Workload("toy", params=1_000_000, tensors=4, layers=(Layer(101, 50, 1), Layer(51, 10, 1)))
COMPUTE = Compute(step_s=0.01, batch=32)


def case(p: int, compute: Compute = COMPUTE) -> Case:
    return Case(LOAD, NET, compute, p, 4, 1e-10)


def test_allreduce_is_compute_plus_bucketed_allreduce():
    it = iteration("allreduce", case(8), model_options("allreduce", {"bucket_mb": 1.0}))
    n, bucket = 4e6, 2**20
    expected = 3 * ring_allreduce(NET, 8, bucket) + ring_allreduce(NET, 8, n - 3 * bucket)
    assert it.comm == pytest.approx(expected) and it.total == pytest.approx(0.01 + expected)
    assert iteration("allreduce", case(1)).total == pytest.approx(0.01)


def test_overlap_hides_communication_behind_backward():
    full = iteration("allreduce", case(8))
    assert iteration("allreduce", case(8), overlap=1.0).exposed == pytest.approx(max(0.0, full.comm - 2 / 3 * 0.01))
    with pytest.raises(OptionError, match="overlap must be in"):
        iteration("allreduce", case(8), overlap=2)


def test_oversubscribed_cores_slow_compute():
    assert iteration("allreduce", case(8, Compute(step_s=0.01, batch=32, cores=2))).compute == pytest.approx(0.04)
    assert iteration("allreduce", case(2, Compute(step_s=0.01, batch=32, cores=2))).compute == pytest.approx(0.01)


def test_adasum_easgd_and_windows():
    assert iteration("adasum", case(4)).comm == pytest.approx(
        adasum_allreduce(NET, 4, 4e6, tensors=4, gamma_adasum=1e-10)
    )
    assert iteration("easgd", case(4), model_options("easgd", {"tau": 8})).comm == pytest.approx(
        ring_allreduce(NET, 4, 4e6) / 8
    )
    # ea-wild, sharded: get and accumulate of n from 3 remote shards, every tau=4 steps
    wild = iteration("ea-wild", case(4)).comm
    assert wild == pytest.approx((6 * 2e-6 + 2 * 4e6 * 3 / 4 * 1e-9) / 4)
    assert iteration("async-easgd", case(4)).comm == pytest.approx(wild + 6 * 2e-6 / 4)  # lock + unlock per shard
    # server layout: rank 0's link carries every worker's 2n
    server = iteration("ea-wild", case(4), model_options("ea-wild", {"layout": "server"})).comm
    assert server == pytest.approx(2 * 4e6 * 3 * 1e-9 / 4)


def test_window_solvers_are_priced_by_their_own_networks_and_schedule():
    """With window networks (fitted to bench windows), an exchange costs what they say, every tau steps."""
    windows = {"wild": Network(alpha=1e-4, beta=3e-9), "locked": Network(alpha=5e-3, beta=4e-9)}
    priced = Case(LOAD, NET, COMPUTE, 4, 4, 1e-10, windows)
    assert iteration("ea-wild", priced).comm == pytest.approx((6 * 1e-4 + 2 * 4e6 * 3 / 4 * 3e-9) / 4)
    assert iteration("async-sgd", priced).comm == pytest.approx(12 * 5e-3 + 2 * 4e6 * 3 / 4 * 4e-9)  # tau=1, locked
    assert iteration("async-easgd", priced, model_options("async-easgd", {"tau": 8})).comm == pytest.approx(
        (12 * 5e-3 + 2 * 4e6 * 3 / 4 * 4e-9) / 8
    )
    assert iteration("allreduce", priced).comm == iteration("allreduce", case(4)).comm  # collectives keep the network
    assert iteration("local-sgd", priced).comm == pytest.approx(ring_allreduce(NET, 4, 4e6) / 4)


def test_kfac_adds_factor_and_inverse_traffic_and_inversions():
    options = model_options("kfac", {"factor_update_steps": 1, "inv_update_steps": 1, "variant": "mpd-kfac"})
    compute = Compute(step_s=0.01, batch=32, gemm_flops=1e12, inverse_flops=1e9)
    it = iteration("kfac", case(2, compute), options)
    dims = [101, 50, 51, 10]
    grads = ring_allreduce(NET, 2, 4e6)
    factors = ring_allreduce(NET, 2, sum(d * d for d in dims) * 4)
    inverses = 2e-6 + 0.5 * sum(d * d for d in dims) * 4 * 1e-9  # allgather at 2 ranks: (p-1) alpha + (p-1)/p N beta
    assert it.comm == pytest.approx(grads + factors + inverses)
    # inversions 101^3 | 51^3 + 50^3 + 10^3 on two ranks: the larger load decides
    inverse_s = max(101**3, 51**3 + 50**3 + 10**3) / 1e9
    factor_s = sum(2 * 32 * (a * a + g * g) for a, g in ((101, 50), (51, 10))) / 1e12
    precondition_s = sum(2 * a * g * (a + g) for a, g in ((101, 50), (51, 10))) / 1e12
    assert it.compute == pytest.approx(0.01 + inverse_s + factor_s + precondition_s)
    assert (
        iteration("kfac", case(2), model_options("kfac", {"variant": "spd-kfac"})).comm
        < iteration("kfac", case(2), model_options("kfac", {"variant": "mpd-kfac"})).comm
    )


def test_workloads_match_known_sizes():
    assert workload("resnet50").params == 25_557_032  # torchvision's count
    assert workload("resnet18").params == 11_689_512
    assert workload("resnet50").forward_flops_per_sample == pytest.approx(8.18e9, rel=0.01)
    assert workload("mlp").params == 64 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10
    with pytest.raises(InputError, match="unknown model 'vgg'"):
        workload("vgg")


def test_bad_options_name_the_problem():
    with pytest.raises(InputError, match="no performance model for solver 'sgd'"):
        model_options("sgd", {})
    with pytest.raises(OptionError, match="does not take option 'tau'"):
        model_options("allreduce", {"tau": 2})
    with pytest.raises(OptionError, match="tau must be >= 1"):
        model_options("ea-wild", {"tau": 0})
