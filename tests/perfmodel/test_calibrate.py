"""Calibration recovers the alpha and beta that generated a sweep."""

import csv

import pytest

from mpisolve.errors import InputError
from mpisolve.perfmodel.calibrate import (
    fit_adasum_gamma,
    fit_contention,
    fit_network,
    fit_node_sum,
    fit_scale_and_latency,
    fit_through_origin,
    fit_window,
    read_sweep,
    read_window_bench,
)
from mpisolve.perfmodel.network import Network, adasum_allreduce, window_exchange
from mpisolve.perfmodel.node import NodeMemory, node_sum
from mpisolve.perfmodel.sharing import SharedCores

SIZES = [4 * 4**k for k in range(13)]  # 4 B to 64 MiB, as bench sweep


def synthetic(net: Network, op: str, *, noise: float = 0.0, gamma_adasum: float = 0.0) -> list[dict]:
    rows = []
    for i, (p, n) in enumerate((p, n) for p in (2, 4, 8) for n in SIZES):
        t = adasum_allreduce(net, p, n, tensors=1, gamma_adasum=gamma_adasum) if op == "adasum" else net.allreduce(p, n)
        rows.append({"ranks": p, "op": op, "bytes": float(n), "seconds": t * (1 + noise * (-1) ** i)})
    return rows


@pytest.mark.parametrize("algorithm", ["ring", "halving-doubling"])
def test_fit_recovers_alpha_and_beta(algorithm):
    truth = Network(alpha=3e-6, beta=2.5e-10, algorithm=algorithm)
    fitted = fit_network(synthetic(truth, "mpi"), op="mpi", algorithm=algorithm)
    assert fitted.alpha == pytest.approx(3e-6, rel=1e-6) and fitted.beta == pytest.approx(2.5e-10, rel=1e-6)
    noisy = fit_network(synthetic(truth, "mpi", noise=0.05), op="mpi", algorithm=algorithm)
    assert noisy.alpha == pytest.approx(3e-6, rel=0.1) and noisy.beta == pytest.approx(2.5e-10, rel=0.1)


def test_fit_recovers_adasum_gamma_and_reads_csv(tmp_path):
    truth = Network(alpha=5e-6, beta=1e-9, algorithm="halving-doubling")
    rows = synthetic(truth, "bucketed") + synthetic(truth, "adasum", gamma_adasum=4e-10)
    path = tmp_path / "sweep.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["ranks", "op", "bytes", "latency_us", "algbw_GBps", "busbw_GBps", "repeats"])
        writer.writerows([r["ranks"], r["op"], int(r["bytes"]), repr(r["seconds"] * 1e6), 0, 0, 10] for r in rows)
    read = read_sweep([path])
    net = fit_network(read, op="bucketed", algorithm="halving-doubling")
    assert net.alpha == pytest.approx(5e-6, rel=1e-6) and net.beta == pytest.approx(1e-9, rel=1e-6)
    assert fit_adasum_gamma(read, net) == pytest.approx(4e-10, rel=1e-4)
    assert fit_adasum_gamma(synthetic(truth, "bucketed"), net) == 0.0


def test_fit_never_goes_negative():
    # Pure bandwidth: a fitted alpha is 0, not a small negative number.
    rows = synthetic(Network(alpha=0.0, beta=1e-9), "mpi", noise=0.02)
    assert fit_network(rows, op="mpi").alpha >= 0


def test_bad_sweeps_fail_clearly(tmp_path):
    with pytest.raises(InputError, match="too few 'sum' rows"):
        fit_network(synthetic(Network(alpha=1e-6, beta=1e-9), "mpi"), op="sum")
    bad = tmp_path / "bad.csv"
    bad.write_text("ranks,op\n2,mpi\n")
    with pytest.raises(InputError, match="missing columns: bytes, latency_us"):
        read_sweep([bad])
    with pytest.raises(InputError, match="cannot read sweep CSV"):
        read_sweep([tmp_path / "absent.csv"])


def window_rows(nets: dict, *, noise: float = 0.0) -> list[dict]:
    """bench windows rows an exchange priced by ``nets`` (per mode) would give, both layouts."""
    rows = []
    for i, (p, n, mode, layout) in enumerate(
        (p, n, m, lay)
        for p in (2, 4, 8)
        for n in (2**18, 2**21, 2**23)
        for m in ("wild", "locked")
        for lay in ("sharded", "server")
    ):
        t = window_exchange(nets[mode], p, n, locked=mode == "locked", layout=layout)
        rows.append(
            {
                "ranks": p,
                "path": "shared",
                "mode": mode,
                "layout": layout,
                "bytes": float(n),
                "seconds": t * (1 + noise * (-1) ** i),
            }
        )
    return rows


def test_window_fit_recovers_each_modes_alpha_and_beta(tmp_path):
    truth = {"wild": Network(alpha=20e-6, beta=0.2e-9), "locked": Network(alpha=400e-6, beta=0.3e-9)}
    path = tmp_path / "w.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["ranks", "path", "mode", "layout", "numel", "bytes", "seconds"])
        writer.writeheader()
        writer.writerows({**r, "numel": int(r["bytes"]) // 4, "bytes": int(r["bytes"])} for r in window_rows(truth))
    fits = fit_window(read_window_bench([path]))
    for mode, net in truth.items():
        assert fits[mode].alpha == pytest.approx(net.alpha, rel=1e-6) and fits[mode].beta == pytest.approx(
            net.beta, rel=1e-6
        )
    noisy = fit_window(window_rows(truth, noise=0.05))
    assert noisy["locked"].alpha == pytest.approx(400e-6, rel=0.1) and noisy["wild"].beta == pytest.approx(
        0.2e-9, rel=0.1
    )


def test_bad_window_benches_fail_clearly(tmp_path):
    with pytest.raises(InputError, match="too few locked sharded rows on the internode path"):
        fit_window(
            window_rows({"wild": Network(alpha=1e-6, beta=1e-9), "locked": Network(alpha=1e-6, beta=1e-9)}),
            path="internode",
        )
    bad = tmp_path / "bad.csv"
    bad.write_text("ranks,op,bytes,latency_us\n2,mpi,4,1.0\n")
    with pytest.raises(InputError, match="not a bench windows CSV"):
        read_window_bench([bad])


def test_contention_fit_recovers_the_workloads_and_counts_other_processes():
    """Steps generated by SharedCores(memory=0.08, contention=0.2, crowding=0.05), on 2 cores of
    which other processes took 0, 0, 0.5 and 0.25 at 1, 2, 4 and 8 ranks, give all three back; a
    workload that slows no further past two ranks a core (measured: this machine's MLP) fits
    no crowding, where a slope through 0 would have priced 4 ranks too low and 8 too high; on
    4 cores the memory term grows as the ranks fill them."""
    terms = {"memory": 0.08, "contention": 0.2, "crowding": 0.05}
    rows = []
    for p, outside in ((1, 0.0), (2, 0.0), (4, 0.5), (8, 0.25)):
        step = 0.01 * SharedCores(cores=2 - outside, **terms).slowdown(p)
        rows.append({"ranks": p, "seconds": step, "outside_cores": outside})
    assert fit_contention(rows, 2) == pytest.approx((0.08, 0.2, 0.05))
    # counted as 2 free cores, the same steps need a larger contention: the outside load matters
    assert fit_contention([{**r, "outside_cores": 0.0} for r in rows], 2)[1] > 0.25
    flat = [{"ranks": p, "seconds": 0.01 * (1 + x) * 1.35, "outside_cores": 0.0} for p, x in ((4, 1), (8, 3))]
    two = {"ranks": 2, "seconds": 0.01 * 1.08, "outside_cores": 0.0}
    fitted = fit_contention([{"ranks": 1, "seconds": 0.01, "outside_cores": 0.0}, two, *flat], 2)
    assert fitted == pytest.approx((0.08, 0.27, 0.0))
    shared = SharedCores(cores=2, **terms)
    four = [{"ranks": p, "seconds": 0.01 * shared.slowdown(p), "outside_cores": 0.0} for p in (1, 3, 4)]
    assert fit_contention(four, 2) == pytest.approx((0.08, 0.2, 0.0))  # nothing past two ranks a core: no crowding
    wide = SharedCores(cores=4, memory=0.1)
    filling = [{"ranks": p, "seconds": 0.01 * wide.slowdown(p), "outside_cores": 0.0} for p in (1, 2, 3, 4)]
    assert fit_contention(filling, 4) == pytest.approx((0.1, 0.0, 0.0))
    with pytest.raises(InputError, match="one 1-rank row"):
        fit_contention(rows[1:], 2)
    with pytest.raises(InputError, match="nothing to fit the contention to"):
        fit_contention(rows[:1], 2)


def test_fit_through_origin():
    assert fit_through_origin([(1.0, 2.0), (3.0, 6.0)]) == pytest.approx(2.0)
    assert fit_through_origin([(1.0, -2.0)]) == 0.0  # bounded at 0
    assert fit_through_origin([(0.0, 5.0)]) == 0.0  # nothing to fit


def test_fit_scale_and_latency():
    """Points made by y = 3 x + 0.5 k give (3, 0.5) back; a fit that would need a
    negative latency keeps it at 0 and fits the scale alone."""
    points = [(x, k, 3 * x + 0.5 * k) for x, k in ((0.3, 4), (0.04, 4), (0.2, 2), (1.0, 1))]
    scale, latency = fit_scale_and_latency(points)
    assert (scale, latency) == pytest.approx((3.0, 0.5))
    points = [(1.0, 1.0, 1.0), (2.0, 1.0, 3.0)]  # y = 2 x - 1: no nonnegative latency
    assert fit_scale_and_latency(points) == pytest.approx((fit_through_origin([(1.0, 1.0), (2.0, 3.0)]), 0.0))
    assert fit_scale_and_latency([]) == (0.0, 0.0)


def test_node_sum_fit_recovers_the_nodes_memory_and_prices_allreduces():
    """Sweep rows generated by node_sum (the latency path up to 64 KiB, the bandwidth path above) give it back;
    a Network with that memory prices a one-node allreduce as the node-shared sum."""
    truth = NodeMemory(node_Bps=12e9, sync_s=80e-6)
    rows = [{"ranks": 4, "op": "bucketed", "bytes": float(n), "seconds": node_sum(truth, 4, n)} for n in SIZES]
    fitted = fit_node_sum(rows)
    assert fitted.node_Bps == pytest.approx(12e9, rel=1e-6) and fitted.sync_s == pytest.approx(80e-6, rel=1e-6)
    net = Network(alpha=1e-6, beta=1e-9, per_node=4, memory=fitted)
    assert net.allreduce(4, 4e6) == pytest.approx(2 * 80e-6 + 5 * 4e6 / 12e9)
    with pytest.raises(InputError, match="one rank count"):
        fit_node_sum(rows + [{**rows[0], "ranks": 8}])
