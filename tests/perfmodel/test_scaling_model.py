"""perf/scaling_model.py's in-loop fits recover the costs that generated a synthetic workload's runs."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))

import scaling_model  # noqa: E402  (a perf script, importable once perf/ is on the path)

from mpisolve.perfmodel.iteration import Case, Compute, iteration  # noqa: E402
from mpisolve.perfmodel.network import Network, window_exchange  # noqa: E402
from mpisolve.perfmodel.node import NodeMemory  # noqa: E402
from mpisolve.perfmodel.workloads import Workload  # noqa: E402

NET = Network(alpha=5e-6, beta=2e-10)
WINDOWS = {"locked": Network(alpha=6e-6, beta=7e-11), "wild": Network(alpha=8e-6, beta=4e-11)}
CAL = scaling_model.Calibration({2: (NET, 3e-10, 0.0)}, {2: WINDOWS}, 2, {}, {}, {}, {})
LOADS = [Workload("synthetic", numel, 3, ()) for numel in (65_536, 1_048_576)]
STEP_S = 0.005


def row(seconds: float) -> dict[str, str]:
    return {"iteration_s": str(seconds), "outside_cores": "0.0"}


def test_fit_in_loop_recovers_a_factor_and_a_latency_per_exchange():
    """Runs made 3x the locked window's price plus 0.3 ms for each of its four latency terms
    at 2 ranks (a get and an accumulate, each with its lock and unlock counted once more)
    give (3, 0.3 ms) back; the wild one, 2x and none, (2, 0)."""
    syncs = []
    for load in LOADS:
        n = load.params * scaling_model.WIRE_BYTES
        locked = window_exchange(WINDOWS["locked"], 2, n, locked=True)
        wild = window_exchange(WINDOWS["wild"], 2, n, locked=False)
        rows = {
            ("async-sgd", 1): row(STEP_S),
            ("async-sgd", 2): row(STEP_S + 3 * locked + 4 * 3e-4),
            ("hogwild-sgd", 1): row(STEP_S),
            ("hogwild-sgd", 2): row(STEP_S + 2 * wild),
            ("allreduce", 1): row(STEP_S),
            ("allreduce", 2): row(STEP_S + NET.allreduce(2, n)),
        }
        syncs.append((load, rows))
    fits = scaling_model.fit_in_loop(CAL, syncs)
    assert fits["locked"] == pytest.approx((3.0, 3e-4))
    assert fits["wild"] == pytest.approx((2.0, 0.0), abs=1e-9)
    assert fits["allreduce"] == pytest.approx((1.0, 0.0), abs=1e-9)


def test_in_loop_at_a_factor_of_zero_keeps_only_the_latency_terms():
    """A fit may find an exchange's bytes free in a training loop (a factor of 0): the node's
    sums then cost their counter waits' latency alone (one wait up to 64 KiB, two above), whatever the bytes."""
    net = replace(NET, per_node=2, memory=NodeMemory(node_Bps=20e9, sync_s=10e-6))
    free = scaling_model.in_loop(net, 0.0, 1e-4)
    assert free.allreduce(2, 4096) == pytest.approx(free.allreduce(2, 32768)) == pytest.approx(1e-4)
    assert free.allreduce(2, 4e6) == pytest.approx(free.allreduce(2, 4e7)) == pytest.approx(2e-4)
    assert scaling_model.in_loop(net, 2.0).allreduce(2, 4e6) == pytest.approx(2 * net.allreduce(2, 4e6))


def test_fit_host_work_recovers_the_work_per_byte_and_fixed_per_solver():
    """abs-sgd's 2-rank runs made the model's iteration plus 0.6 ns a gradient byte and 0.45 ms,
    adasum's plus 1.5 ns and none, give each solver's back; with no runs of a solver there is
    nothing to fit."""
    work = {"abs-sgd": (0.6e-9, 4.5e-4), "adasum": (1.5e-9, 0.0)}
    syncs = []
    for load in LOADS:
        net, gamma = CAL.network(2)
        case = Case(
            load, net, Compute(step_s=STEP_S, batch=32), 2, 4, gamma, CAL.window_networks(2), host_s_per_byte=0.0
        )
        rows = {}
        for solver, (per_byte, fixed) in work.items():
            rows[(solver, 1)] = row(STEP_S)
            rows[(solver, 2)] = row(iteration(solver, case).total + per_byte * load.params * 4 + fixed)
        syncs.append((load, rows))
    for solver, fit in work.items():
        assert scaling_model.fit_host_work(CAL, syncs, solver) == pytest.approx(fit, abs=1e-12)
    assert scaling_model.fit_host_work(CAL, [(LOADS[0], {("allreduce", 1): row(STEP_S)})], "adasum") is None
