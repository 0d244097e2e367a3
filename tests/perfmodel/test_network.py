"""The collective cost formulas on values worked out by hand."""

import math

import pytest

from mpisolve.errors import OptionError
from mpisolve.perfmodel.network import (
    Network,
    adasum_allreduce,
    allgather,
    broadcast,
    halving_doubling_allreduce,
    recursive_doubling_allreduce,
    ring_allreduce,
)

NET = Network(alpha=1e-6, beta=1e-9, gamma=0.0)


@pytest.mark.parametrize("p", [2, 3, 4, 8, 1024])
def test_ring_allreduce_is_2_p_minus_1_alpha_plus_2_p_minus_1_over_p_n_beta(p):
    n = 8 * 2**20
    assert ring_allreduce(NET, p, n) == pytest.approx(2 * (p - 1) * 1e-6 + 2 * (p - 1) / p * n * 1e-9)


def test_gamma_adds_p_minus_1_over_p_n_gamma():
    net = Network(alpha=0.0, beta=0.0, gamma=2e-10)
    assert ring_allreduce(net, 4, 1000) == pytest.approx(0.75 * 1000 * 2e-10)
    assert halving_doubling_allreduce(net, 4, 1000) == pytest.approx(0.75 * 1000 * 2e-10)


def test_halving_doubling_power_of_two_and_fold():
    n = 1e6
    assert halving_doubling_allreduce(NET, 8, n) == pytest.approx(2 * 3 * 1e-6 + 2 * 7 / 8 * n * 1e-9)
    # 6 ranks: 2 extra ranks fold in and out (2 messages of n), then halving-doubling over 4
    assert halving_doubling_allreduce(NET, 6, n) == pytest.approx(
        2 * (1e-6 + n * 1e-9) + 2 * 2 * 1e-6 + 2 * 3 / 4 * n * 1e-9
    )
    assert NET.allreduce(8, n) == ring_allreduce(NET, 8, n)
    assert Network(alpha=1e-6, beta=1e-9, algorithm="halving-doubling").allreduce(8, n) == halving_doubling_allreduce(
        NET, 8, n
    )


def test_other_collectives():
    assert recursive_doubling_allreduce(NET, 5, 100) == pytest.approx(3 * (1e-6 + 100e-9))
    assert broadcast(NET, 4, 1000) == pytest.approx((2 + 3) * 1e-6 + 1.5 * 1000e-9)
    assert allgather(NET, 4, 1000) == pytest.approx(3e-6 + 750e-9)
    for f in (ring_allreduce, halving_doubling_allreduce, recursive_doubling_allreduce, broadcast, allgather):
        assert f(NET, 1, 1e9) == 0.0


def test_adasum_is_halving_doubling_plus_level_statistics_plus_combine():
    n, tensors = 4e6, 10
    stats = sum(recursive_doubling_allreduce(NET, 2**k, 24 * tensors) for k in (1, 2, 3))
    expected = halving_doubling_allreduce(NET, 8, n) + stats + 7 / 8 * n * 3e-10
    assert adasum_allreduce(NET, 8, n, tensors=tensors, gamma_adasum=3e-10) == pytest.approx(expected)
    assert adasum_allreduce(NET, 8, n, tensors=tensors, gamma_adasum=0) > halving_doubling_allreduce(NET, 8, n)


def test_link_speed_and_bad_values():
    net = Network.from_link(gbit_s=100, latency_us=2)
    assert net.beta == pytest.approx(8e-11) and net.alpha == pytest.approx(2e-6)
    with pytest.raises(OptionError, match="beta must be >= 0"):
        Network(alpha=0, beta=-1)
    with pytest.raises(OptionError, match="alpha must be >= 0"):
        Network(alpha=math.nan, beta=0)
    with pytest.raises(OptionError, match="algorithm must be one of"):
        Network(alpha=0, beta=0, algorithm="tree")


def test_ranks_of_one_node_use_its_links():
    """4 GPUs a node: up to 4 ranks, a byte costs intra_beta; beyond, the node's network link's beta."""
    node = Network(alpha=1e-6, beta=1e-9, per_node=4, intra_beta=1e-10)
    inside = Network(alpha=1e-6, beta=1e-10)
    assert node.allreduce(4, 1e6) == pytest.approx(ring_allreduce(inside, 4, 1e6))
    assert node.allreduce(8, 1e6) == pytest.approx(ring_allreduce(Network(alpha=1e-6, beta=1e-9), 8, 1e6))
    assert allgather(node, 2, 1000) == pytest.approx(allgather(inside, 2, 1000))
    assert Network(alpha=1e-6, beta=1e-9, per_node=4).allreduce(4, 1e6) == pytest.approx(
        ring_allreduce(Network(alpha=1e-6, beta=1e-9), 4, 1e6)
    )  # no intra_beta: the network's
    with pytest.raises(OptionError, match="per_node must be >= 1"):
        Network(alpha=0, beta=0, per_node=0)
    with pytest.raises(OptionError, match="intra_beta must be >= 0"):
        Network(alpha=0, beta=0, intra_beta=-1.0)
