"""Each solver's iteration model on hand-worked values."""

import math
from dataclasses import replace

import pytest

from mpisolve.errors import InputError, OptionError
from mpisolve.perfmodel.iteration import Case, Compute, iteration, model_options
from mpisolve.perfmodel.network import Network, adasum_allreduce, adasum_levels, ring_allreduce
from mpisolve.perfmodel.sharing import SharedCores
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


def ring(n: float) -> float:
    """A ring allreduce of n bytes at 8 ranks on NET, worked by hand."""
    return 14 * 2e-6 + 1.75 * n * 1e-9


def test_overlap_follows_backward_layer_by_layer():
    """Backward (2/3 of 10 ms) reaches the last layer (1,020 of 11,120 flops; 510 of 5,560
    weights: 366,906 bytes) first, then the first (3,633,094 bytes) at its end."""
    backward, last, first = 2 / 3 * 0.01, 4e6 * 510 / 5560, 4e6 * 5050 / 5560
    ready = backward * 1020 / 11120
    overlapped = replace(case(8), overlap=True)
    # 0.5 MiB buckets: the last layer's bucket goes when the first layer's would overflow it
    small = iteration("allreduce", overlapped, model_options("allreduce", {"bucket_mb": 0.5}))
    assert ready + ring(last) < backward  # its exchange ends during backward
    assert small.exposed == pytest.approx(ring(first)) and small.comm == pytest.approx(ring(last) + ring(first))
    # one 100 MiB bucket waits for the whole backward; Horovod's fusion sends what is ready whenever the network is free
    big = iteration("allreduce", overlapped, model_options("allreduce", {"bucket_mb": 100}))
    assert big.exposed == pytest.approx(ring(4e6))
    ready_fusion = iteration("allreduce", overlapped, model_options("allreduce", {"bucket_mb": 100, "fusion": "ready"}))
    assert ready_fusion.exposed == pytest.approx(ring(first))
    assert iteration("allreduce", case(8)).exposed == pytest.approx(ring(4e6))  # no overlap: all of it


def test_horovods_cycle_waits_for_the_next_tick_and_its_negotiation():
    """One layer of 1 MB, ready at backward's end (30 ms of a 45 ms step), 2 ranks, 1 ms a
    message. Idle, a tick of Horovod's loop lasts its 8 ms sleep plus 2 messages (rank 0
    receives a DONE and sends one): 10 ms, so 30 ms falls on a tick's start and the
    gradients wait for the next collection, on average half a tick (5 ms). That tick
    costs 3 messages (the ready list, both DONEs) and 1 for the response before the ring
    (2 alpha + n beta at 2 ranks: 3 ms) starts: 5 + 4 + 3 ms after backward."""
    one = Workload("one", params=250_000, tensors=1, layers=(Layer(10, 10, 1),))
    net = Network(alpha=1e-3, beta=1e-9)
    slow = Case(one, net, Compute(step_s=0.045, batch=32), 2, 4, 0.0, overlap=True)
    cycle = {"fusion": "cycle", "cycle_ms": 8.0}
    assert iteration("allreduce", slow, model_options("allreduce", cycle)).exposed == pytest.approx(0.012)
    # without the negotiation the tick is the 8 ms sleep: 32 ms of backward, 4 ms on average, then the ring
    quiet = replace(slow, compute=Compute(step_s=0.048, batch=32))
    it = iteration("allreduce", quiet, model_options("allreduce", {**cycle, "negotiation": False}))
    assert it.exposed == pytest.approx(0.004 + 0.003) and it.comm == pytest.approx(0.003)
    # no sleep, no messages: the exchange starts as the gradients are ready
    free = model_options("allreduce", {"fusion": "cycle", "cycle_ms": 0.0, "negotiation": False})
    assert iteration("allreduce", slow, free).exposed == pytest.approx(0.003)


def test_horovods_cycle_passes_empty_ticks_at_once_and_bounds_itself_without_overlap():
    """A near-zero sleep with no messages prices the loop as no sleep at all (the ticks that
    find nothing ready are skipped, not walked: 10^-12 s ticks over a 30 ms backward would
    not end); without overlap every gradient waits for backward's end, then the loop: at
    least what overlap leaves (the one layer is ready at backward's end either way, so the
    same here), and with two layers more than overlap leaves."""
    one = Workload("one", params=250_000, tensors=1, layers=(Layer(10, 10, 1),))
    slow = Case(one, Network(alpha=1e-3, beta=1e-9), Compute(step_s=0.045, batch=32), 2, 4, 0.0, overlap=True)
    tiny = model_options("allreduce", {"fusion": "cycle", "cycle_ms": 1e-9, "negotiation": False})
    assert iteration("allreduce", slow, tiny).exposed == pytest.approx(0.003)
    cycle = model_options("allreduce", {"fusion": "cycle", "cycle_ms": 8.0})
    hidden = iteration("allreduce", slow, cycle).exposed
    assert iteration("allreduce", replace(slow, overlap=False), cycle).exposed == pytest.approx(hidden)
    two = Workload("two", params=250_000, tensors=2, layers=(Layer(25, 5000, 1), Layer(25, 5000, 1)))
    both = replace(slow, workload=two)
    assert (
        iteration("allreduce", replace(both, overlap=False), cycle).exposed
        > iteration("allreduce", both, cycle).exposed
    )


def test_horovods_cycle_queues_each_fused_response_on_the_stream():
    """Two layers ready together, too large to fuse in 0.5 MiB: two responses, each announced
    by its own message and sent as announced, the second after the first on the stream."""
    two = Workload("two", params=250_000, tensors=2, layers=(Layer(25, 5000, 1), Layer(25, 5000, 1)))
    net = Network(alpha=1e-3, beta=1e-9)
    # the first layer (backward's last) is ready at 15 ms, the second at 30 ms: a 1 s tick collects both at once
    both = Case(two, net, Compute(step_s=0.045, batch=32), 2, 4, 0.0, overlap=True)
    options = model_options("allreduce", {"fusion": "cycle", "cycle_ms": 998.0, "bucket_mb": 0.5})
    half = 2e-3 + 0.5e6 * 1e-9  # a ring of 0.5 MB at 2 ranks
    # phases 62.5, 187.5, ... ms of a 1,000 ms tick: all collect both layers at the first tick past 30 ms
    waits = [(k + 0.5) * 0.125 - 0.030 for k in range(8)]
    expected = sum(waits) / 8 + 3e-3 + 1e-3 + max(1e-3, half) + half
    it = iteration("allreduce", both, options)
    assert it.exposed == pytest.approx(expected) and it.comm == pytest.approx(2 * half)


def test_kfac_inversions_priced_by_a_fitted_exponential():
    """inverse_ms and inverse_growth replace the flops of each inversion: d-kfac inverts all
    four factors (101, 50, 51, 10) on every rank, 2 ms x exp(0.01 d) each."""
    every = {"factor_update_steps": 1, "inv_update_steps": 1, "variant": "d-kfac"}
    compute = Compute(step_s=0.01, batch=32, gemm_flops=1e12, inverse_flops=1e9)
    flops = iteration("kfac", case(2, compute), model_options("kfac", every))
    fitted = iteration(
        "kfac", case(2, compute), model_options("kfac", {**every, "inverse_ms": 2.0, "inverse_growth": 0.01})
    )
    dims = [101, 50, 51, 10]
    by_flops = sum(d**3 for d in dims) / 1e9
    by_fit = sum(2e-3 * math.exp(0.01 * d) for d in dims)
    assert fitted.compute - flops.compute == pytest.approx(by_fit - by_flops)
    with pytest.raises(OptionError, match="inverse_ms must be >= 0"):
        model_options("kfac", {"inverse_ms": -1.0})
    with pytest.raises(OptionError, match="inverse_growth goes with inverse_ms > 0"):
        model_options("kfac", {"inverse_growth": 0.01})


def test_abs_sgd_waits_only_for_what_outlasts_a_step():
    slow = Network(alpha=2e-6, beta=1e-8)  # 4 MB take 70 ms at 8 ranks: longer than the 10 ms step
    it = iteration("abs-sgd", Case(LOAD, slow, COMPUTE, 8, 4, 1e-10))
    assert it.exposed == pytest.approx(it.comm - 0.01)
    assert iteration("abs-sgd", case(8)).exposed == 0.0  # 7 ms: hidden behind the step


def test_abs_sgd_and_adasum_pay_their_host_work_at_several_ranks():
    """4 MB of gradients at 2 ns a byte: 8 ms more compute a micro-batch (9 with 1 ms fixed), times the shared
    cores' slowdown (2 cores, 4 ranks, contention 0.1: 2.2); by default abs-sgd's 24 bytes moved
    a byte at a third of gamma (1e-11 s a byte reduced) and Adasum nothing; nothing at one rank."""
    measured = replace(case(2), host_s_per_byte=2e-9)
    assert iteration("abs-sgd", measured).compute == pytest.approx(0.01 + 8e-3)
    assert iteration("abs-sgd", replace(measured, host_s=1e-3)).compute == pytest.approx(0.01 + 9e-3)
    shared = Compute(step_s=0.01, batch=32, sharing=SharedCores(cores=2, contention=0.1))
    assert iteration("abs-sgd", replace(measured, p=4, compute=shared)).compute == pytest.approx((0.01 + 8e-3) * 2.2)
    assert iteration("abs-sgd", replace(measured, p=1)).compute == pytest.approx(0.01)
    by_gamma = replace(case(2), net=Network(alpha=2e-6, beta=1e-9, gamma=1e-11))
    assert iteration("abs-sgd", by_gamma).compute == pytest.approx(0.01 + 24 * 1e-11 / 3 * 4e6)
    assert iteration("adasum", by_gamma).compute == pytest.approx(0.01)
    assert iteration("adasum", replace(measured, p=4, compute=shared)).compute == pytest.approx((0.01 + 8e-3) * 2.2)
    assert iteration("adasum", replace(measured, p=1)).compute == pytest.approx(0.01)


def test_shared_cores_slow_compute_and_price_waits_and_locks():
    """2 cores, 8 ranks: 3 extra ranks a core. The step takes 4 x (1 + 0.1 + 0.05 x 2) (a slope of
    0.1 a rank a core would give 4 x 1.3); a blocking exchange 3 x 1 ms more (Adasum: at each
    of its 3 levels), each of async-sgd's 2 x 7 lock acquisitions 3 x 2 ms more."""
    shared = SharedCores(cores=2, contention=0.1, crowding=0.05, wait_s=1e-3, lock_s=2e-3)
    compute = Compute(step_s=0.01, batch=32, sharing=shared)
    solvers = (("allreduce", 3e-3), ("adasum", 3 * 3e-3), ("async-sgd", 14 * 6e-3), ("ea-wild", 0.0))
    plain = {s: iteration(s, case(8)) for s, _ in solvers}
    for solver, waited in solvers:
        it = iteration(solver, case(8, compute))
        assert it.compute == pytest.approx(0.01 * 4 * 1.2)
        assert it.comm == pytest.approx(plain[solver].comm + waited)
    at_two = iteration("allreduce", case(2, compute))  # a core each: nothing changes
    assert at_two.compute == pytest.approx(0.01) and at_two.comm == pytest.approx(iteration("allreduce", case(2)).comm)
    assert SharedCores(cores=1.5).slowdown(3) == pytest.approx(2.0)  # cores less what other processes used
    memory = SharedCores(cores=4, memory=0.1)  # the machine's cache and memory, shared as the ranks fill its cores
    assert [memory.slowdown(p) for p in (1, 2, 4, 8)] == pytest.approx([1.0, 1 + 0.1 / 3, 1.1, 2 * 1.1])
    assert shared.slowdown(4) == pytest.approx(2 * 1.1)  # two ranks a core: contention, no crowding yet
    assert shared.slowdown(3) == pytest.approx(1.5 * 1.05)  # part of the way to two a core
    with pytest.raises(OptionError, match="cores must be > 0"):
        SharedCores(cores=0)


def test_adasum_passes_a_level_a_halving_and_one_more_for_the_fold():
    assert [adasum_levels(p) for p in (1, 2, 3, 4, 5, 6, 8, 12, 16)] == [0, 1, 2, 2, 3, 3, 3, 4, 4]


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


def test_spd_kfac_pipelines_its_factors_with_the_step():
    """With overlap, SPD-KFAC's factor allreduce runs while the step computes: only what the
    network cannot fit into the step is waited for; MPD-KFAC allreduces the factors after backward."""
    every = {"factor_update_steps": 1, "inv_update_steps": 1, "pack_triangles": False}
    overlapped = replace(case(8), overlap=True)
    spd = iteration("kfac", overlapped, model_options("kfac", {**every, "variant": "spd-kfac"}))
    mpd = iteration("kfac", overlapped, model_options("kfac", {**every, "variant": "mpd-kfac"}))
    dims = [101, 50, 51, 10]
    factors = ring(sum(d * d for d in dims) * 4)
    inverses = 7 * 2e-6 + 7 / 8 * sum(d * d for d in dims) * 4 * 1e-9
    grads = iteration("allreduce", overlapped)
    assert mpd.exposed == pytest.approx(grads.exposed + factors + inverses)
    assert spd.exposed == pytest.approx(max(grads.exposed, grads.comm + factors - 0.01) + inverses)
    assert spd.comm == pytest.approx(mpd.comm)


@pytest.mark.parametrize(
    ("name", "params", "gflops"),
    [  # torchvision's documented parameter counts and GFLOPS (multiply-adds); Inception V3 less its auxiliary head
        ("resnet18", 11_689_512, 1.81),
        ("resnet50", 25_557_032, 4.09),
        ("resnet101", 44_549_160, 7.80),
        ("resnet152", 60_192_808, 11.51),
        ("vgg16", 138_357_544, 15.47),
        # the auxiliary head: 768x128 and 128x768x5x5 convolutions with batch norm, a 768x1000 classifier
        ("inception-v3", 27_161_264 - (768 * 128 + 256 + 128 * 768 * 25 + 1536 + 769_000), 5.71),
    ],
)
def test_imagenet_workloads_match_published_sizes(name, params, gflops):
    load = workload(name)
    assert load.params == params
    assert load.forward_flops_per_sample / 2 == pytest.approx(gflops * 1e9, rel=0.01)


def test_workloads_match_known_sizes():
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
