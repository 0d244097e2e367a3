"""``bench sweep`` on real ranks: every op at every size, checked results, nccl-tests' busbw, CSV."""

import argparse
import csv

import pytest
import torch

from mpisolve import bench
from mpisolve.bench import sweep
from mpisolve.comm.buckets import GradientBuckets
from mpisolve.comm.communicator import Communicator
from mpisolve.comm.onetensor import one_tensor
from mpisolve.comm.shm import MIN_BYTES_ENV, node_group
from mpisolve.errors import InputError


def sweep_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(["sweep", *argv])


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3, 4)
def test_sweep_rows_and_csv(tmp_path_factory):
    comm = Communicator()
    path = comm.bcast_object(str(tmp_path_factory.mktemp("sweep") / "s.csv") if comm.rank == 0 else None)
    args = sweep_args("--max-bytes", "4K", "--factor", "4", "--repeats", "2", "--small-repeats", "3", "--csv", path)
    result = sweep.run(args, comm)
    sizes = [4, 16, 64, 256, 1024, 4096]
    assert result["ops"] == list(sweep.available_ops())
    assert [(r["bytes"], r["op"]) for r in result["rows"]] == [(s, op) for s in sizes for op in result["ops"]]
    for row in result["rows"]:
        assert row["ranks"] == comm.size and row["latency_us"] > 0 and row["repeats"] == 3
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / (row["latency_us"] * 1e-6) / 1e9)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * (comm.size - 1) / comm.size)
    comm.barrier()
    with open(path, newline="") as f:
        written = list(csv.DictReader(f))
    assert [(int(r["bytes"]), r["op"]) for r in written] == [(r["bytes"], r["op"]) for r in result["rows"]]
    # Each op's ratio to flat MPI at every size, with the layout it was measured on.
    assert result["nodes"] == comm.nodes and result["ranks_per_node"] == comm.local_size
    latency = {(r["op"], r["bytes"]): r["latency_us"] for r in result["rows"]}
    assert set(result["ratios"]) == set(result["ops"]) - {"mpi"}
    for op, by_size in result["ratios"].items():
        assert by_size == {s: pytest.approx(latency[op, s] / latency["mpi", s]) for s in sizes}


def test_ratio_table_marks_the_sizes_where_a_path_is_slower_than_mpi():
    rows = [
        {"op": op, "bytes": size, "latency_us": latency}
        for size, mpi, bucketed in ((4096, 10.0, 5.0), (65536, 20.0, 30.0))
        for op, latency in (("mpi", mpi), ("bucketed", bucketed))
    ]
    ratios = sweep.ratios_to_mpi(rows)
    assert ratios == {"bucketed": {4096: 0.5, 65536: 1.5}}
    lines = sweep.ratio_table("one node, 2 ranks", ratios).splitlines()
    assert lines[0] == "bench sweep, one node, 2 ranks: latency / flat MPI_Allreduce"
    assert lines[2].split() == ["4096", "0.50x"] and lines[3].split() == ["65536", "1.50x*"]
    assert sweep.ratios_to_mpi([r for r in rows if r["op"] != "mpi"]) == {}


@pytest.mark.mpi(min_size=2)
def test_a_wrong_result_is_caught():
    comm = Communicator()
    right = sweep.make_case("sum", 3, comm)
    broken = sweep.Case(run=lambda: None, result=lambda: torch.zeros(3), want=right.want)
    with pytest.raises(RuntimeError, match="broken of 12 bytes gave a wrong result"):
        sweep.check(broken, "broken", comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--min-bytes", "6"], "multiple of 4"),
        (["--min-bytes", "64", "--max-bytes", "16"], "below --min-bytes"),
        (["--factor", "1"], "--factor must be >= 2"),
        (["--ops", "mpi,max"], "unknown op 'max'"),
    ],
)
def test_bad_input_is_named(argv, message):
    with pytest.raises(InputError, match=message):
        sweep.run(sweep_args(*argv), Communicator())


@pytest.mark.mpi(min_size=2)
def test_adasum_is_offered_exactly_when_mpisolve_has_it():
    from mpisolve.comm.collectives import REDUCE_OPS

    if "adasum" in REDUCE_OPS:
        assert "adasum" in sweep.available_ops()
    else:
        with pytest.raises(InputError, match="does not have yet"):
            sweep.run(sweep_args("--ops", "adasum"), Communicator())


def path_rows(node: list[float], mpi: list[float]) -> list[dict]:
    sizes = [4096 * 4**i for i in range(len(node))]
    return [
        {"op": op, "bytes": size, "latency_us": latency}
        for op, latencies in (("bucketed-node", node), ("bucketed-mpi", mpi))
        for size, latency in zip(sizes, latencies)
    ]


@pytest.mark.parametrize(
    ("node", "mpi", "crossover"),
    [
        ([30, 20, 10, 5], [20, 20, 20, 20], 16384),  # no slower from 16 KiB (a tie counts)
        ([30, 10, 30, 5], [20, 20, 20, 20], 262144),  # faster at 16 KiB, then slower: from 256 KiB
        ([10, 10, 10, 10], [20, 20, 20, 20], 0),  # every size measured
        ([10, 10, 10, 30], [20, 20, 20, 20], None),  # slower at the largest size: none
    ],
)
def test_the_measured_crossover_is_where_node_shared_buckets_stay_no_slower(node, mpi, crossover):
    assert sweep.measured_crossover(path_rows(node, mpi)) == crossover


def test_the_crossover_line_names_what_to_set():
    line = sweep.crossover_line("2 node(s) x 2 ranks", 262144, 1048576, [262144, 1048576])
    assert "from 262144 bytes up: MPISOLVE_NODE_SHM_MIN_BYTES=262144 (this layout's default: 1048576)" in line
    rows = path_rows([10, 30, 10, 30], [20, 20, 20, 20])  # no slower at 4 KiB and 64 KiB only
    assert sweep.no_slower_sizes(rows) == [4096, 65536]
    line = sweep.crossover_line("one node, 2 ranks", None, 0, sweep.no_slower_sizes(rows))
    assert "(node-shared no slower at: 4096, 65536)" in line and "MPISOLVE_NODE_SHM=0" in line


def test_the_table_keeps_long_op_names_apart():
    header = sweep.ratio_table("one node, 2 ranks", {"bucketed": {4: 1.0}, "bucketed-node": {4: 0.5}}).splitlines()[1]
    assert header.split() == ["bytes", "bucketed", "bucketed-node"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 3)
def test_sum_and_average_timed_together_each_keep_their_agreed_signature():
    """Timed in turn on one communicator, each call would agree its signature anew (onetensor)."""
    comm = Communicator()
    forced = sweep.path_communicators(["mpi", "sum", "average"], comm)
    args = sweep_args("--repeats", "2", "--small-repeats", "2")
    rows = sweep.timed_rows(["mpi", "sum", "average"], [4096], args, comm, forced)
    assert [row["op"] for row in rows] == ["mpi", "sum", "average"]
    for op, on in (("sum", comm), ("average", forced["average"])):
        agreed = one_tensor(on).agreed
        assert agreed is not None and agreed[0][:3] == (torch.float32, (1024,), op)
    forced["average"].free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.cluster
@pytest.mark.ranks(2, 3)
def test_the_bucket_path_timed_on_each_path_at_every_size_gives_the_crossover(monkeypatch):
    comm = Communicator()
    args = sweep_args("--ops", "mpi,bucketed-node,bucketed-mpi", "--max-bytes", "4K", "--repeats", "2")
    result = sweep.run(args, comm)
    assert {r["op"] for r in result["rows"]} == {"mpi", "bucketed-node", "bucketed-mpi"}
    assert result["crossover_bytes"] == sweep.measured_crossover(result["rows"])
    assert result["default_crossover_bytes"] == node_group(comm).min_bytes
    assert result["node_no_slower_bytes"] == sweep.no_slower_sizes(result["rows"])
    assert "crossover_bytes" not in sweep.run(sweep_args("--ops", "mpi,bucketed", "--max-bytes", "4"), comm)
    # Each forced path is the one named, whatever the crossover: a 4-byte bucket below one of 1 MiB.
    monkeypatch.setenv(MIN_BYTES_ENV, str(1 << 20))
    forced = sweep.path_communicators(list(sweep.PATH_OPS), comm)
    on_node = []
    for op in sweep.PATH_OPS:
        grads = GradientBuckets([torch.nn.Parameter(torch.zeros(1))], forced[op], bucket_bytes=4)
        on_node.append(grads.node is not None)
        grads.close()
        forced[op].free()
    assert on_node == [True, False]


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)
def test_node_shared_buckets_are_refused_by_name_where_they_do_not_apply():
    comm = Communicator()
    alone = comm.split(comm.rank)  # one rank per communicator: no node-shared sums
    with pytest.raises(InputError, match="bucketed-node needs node-shared sums on this layout"):
        sweep.run(sweep_args("--ops", "bucketed-node"), alone)
