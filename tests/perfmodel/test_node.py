"""The node level of the cost model: its pieces, its limits, and its fit."""

import pytest

from mpisolve.errors import OptionError
from mpisolve.perfmodel.network import Network
from mpisolve.perfmodel.node import NodeMemory, fit_node_memory, node_allreduce, node_sum

MEM = NodeMemory(node_Bps=10e9, sync_s=20e-6)
NET = Network(alpha=5e-6, beta=1e-10, gamma=1e-11)


def test_one_rank_per_node_is_the_network_alone():
    assert node_sum(MEM, 1, 1e6) == 0
    assert node_allreduce(MEM, NET, 4, 1, 1e6) == NET.allreduce(4, 1e6)
    assert node_allreduce(MEM, NET, 4, 1, 100) == NET.small_allreduce(4, 100)


def test_one_node_is_the_memory_alone_and_each_node_sends_a_slice_per_rank():
    n = 47e6
    assert node_allreduce(MEM, NET, 1, 4, n) == pytest.approx(2 * 20e-6 + 5 * n / 10e9)
    assert node_allreduce(MEM, NET, 2, 4, n) == pytest.approx(node_sum(MEM, 4, n) + NET.allreduce(2, n / 4))


def test_latency_path_below_the_threshold():
    n = 4096
    assert node_sum(MEM, 8, n) == pytest.approx(20e-6 + 8 * 9 * n / 10e9)
    assert node_allreduce(MEM, NET, 2, 8, n) == pytest.approx(node_sum(MEM, 8, n) + NET.small_allreduce(2, n))


def test_fit_recovers_the_parameters():
    n = 47e6
    ranks = [2, 4, 8]
    seconds = [node_sum(MEM, p, n) for p in ranks]
    fitted = fit_node_memory(ranks, n, seconds)
    assert fitted.node_Bps == pytest.approx(10e9) and fitted.sync_s == pytest.approx(20e-6, rel=1e-3)


def test_bad_input_is_named():
    with pytest.raises(OptionError, match="node_Bps"):
        NodeMemory(node_Bps=0, sync_s=0)
    with pytest.raises(OptionError, match="two or more different rank counts"):
        fit_node_memory([4, 4], 1e6, [1.0, 1.0])


def test_fit_bounds_the_counter_wait_at_zero():
    """Times growing faster than the bytes: the unbounded fit's wait is negative; the bound refits the bandwidth."""
    n = 1e6
    ranks, seconds = [2, 4, 8], [3e-3, 5e-3, 12e-3]
    fitted = fit_node_memory(ranks, n, seconds)
    assert fitted.sync_s == 0.0
    x = [(p + 1) * n for p in ranks]  # least squares through the origin: t = x / node_Bps
    assert fitted.node_Bps == pytest.approx(sum(v * v for v in x) / sum(v * t for v, t in zip(x, seconds)))
