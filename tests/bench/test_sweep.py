"""``bench sweep`` on real ranks: every op at every size, checked results, nccl-tests' busbw, CSV."""

import argparse
import csv

import pytest
import torch

from mpisolve import bench
from mpisolve.bench import sweep
from mpisolve.comm.communicator import Communicator
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
