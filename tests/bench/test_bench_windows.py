"""``bench windows`` on real ranks: one row per mode, layout and size, written as the CSV the model reads."""

import argparse

import pytest

from mpisolve import bench
from mpisolve.bench import windows
from mpisolve.comm.communicator import Communicator
from mpisolve.perfmodel.calibrate import read_window_bench


def windows_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(["windows", *argv])


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2)
def test_rows_per_size_and_csv_for_the_model(tmp_path_factory):
    comm = Communicator()
    path = comm.bcast_object(str(tmp_path_factory.mktemp("windows") / "w.csv") if comm.rank == 0 else None)
    args = windows_args(
        "--numel",
        "64,4096",
        "--paths",
        "shared",
        "--no-progress-overhead",
        "--repeats",
        "2",
        "--warmup",
        "0",
        "--csv",
        path,
    )
    result = windows.run(args, comm)
    assert "progress_overhead" not in result
    expected = [
        (n, mode, layout) for n in (64, 4096) for mode in ("wild", "locked") for layout in ("sharded", "server")
    ]
    assert [(r["numel"], r["mode"], r["layout"]) for r in result["rows"]] == expected
    assert all(r["path"] == "shared" and r["bytes"] == 4 * r["numel"] and r["seconds"] > 0 for r in result["rows"])
    comm.barrier()
    read = read_window_bench([path])
    assert [(int(r["bytes"]), r["mode"], r["layout"]) for r in read] == [(4 * n, m, lay) for n, m, lay in expected]
