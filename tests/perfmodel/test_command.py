"""``python -m mpisolve model``: its table, and bad input exiting 2 with one line."""

import csv
import subprocess
import sys

import pytest


def model(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mpisolve", "model", *args], capture_output=True, text=True, timeout=60
    )


def test_projects_every_rank_count(tmp_path):
    out = tmp_path / "p.csv"
    done = model("--solver", "allreduce,ea-wild", "--model", "resnet18", "--ranks", "1,16,1024", "--csv", str(out))
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(out.open()))
    assert [(r["solver"], int(r["ranks"])) for r in rows] == [
        (s, p) for s in ("allreduce", "ea-wild") for p in (1, 16, 1024)
    ]
    first = rows[0]
    assert float(first["efficiency"]) == pytest.approx(1.0) and float(first["samples_per_s"]) == pytest.approx(6000)
    allreduce = [float(r["efficiency"]) for r in rows if r["solver"] == "allreduce"]
    assert allreduce == sorted(allreduce, reverse=True)  # efficiency falls with ranks
    assert "allreduce" in done.stdout and "1024" in done.stdout


def test_window_calibration_prices_the_window_solvers(tmp_path):
    """Window exchanges fitted to a bench windows CSV (10 ms each: far slower than the network) cost what it says."""
    bench = tmp_path / "w.csv"
    lines = ["ranks,path,mode,layout,numel,bytes,seconds"]
    lines += [f"4,internode,{m},sharded,{n},{4 * n},0.01" for m in ("locked", "wild") for n in (1000, 10**6)]
    bench.write_text("\n".join(lines) + "\n")
    base = ["--solver", "ea-wild,allreduce", "--model", "resnet18", "--ranks", "4"]
    plain, priced = tmp_path / "plain.csv", tmp_path / "priced.csv"
    assert model(*base, "--csv", str(plain)).returncode == 0
    done = model(*base, "--csv", str(priced), "--window-calibration", str(bench))
    assert done.returncode == 0, done.stderr
    before, after = (list(csv.DictReader(path.open())) for path in (plain, priced))
    assert float(after[0]["comm_ms"]) == pytest.approx(10 / 4)  # ea-wild: a 10 ms exchange every tau=4 steps
    assert float(before[0]["comm_ms"]) < 2
    assert after[1]["comm_ms"] == before[1]["comm_ms"]  # allreduce keeps the network


def test_published_workloads_take_their_gpu_figures_and_a_node_level(tmp_path):
    """--gpu p100 prices VGG-16 at TensorFlow's published 154 images/s; four GPUs a node share
    its link, and inside one node they talk over --intra-bandwidth; --baseline sets the efficiency's base."""
    out = tmp_path / "p.csv"
    args = ["--solver", "allreduce", "--model", "vgg16", "--gpu", "p100", "--batch", "64", "--ranks", "4,8"]
    args += ["--gpus-per-node", "4", "--intra-bandwidth", "10", "--network", "roce25", "--csv", str(out)]
    done = model(*args, "--baseline", "4")
    assert done.returncode == 0, done.stderr
    node, two = list(csv.DictReader(out.open()))
    assert float(node["compute_ms"]) == pytest.approx(64 / 154 * 1e3)
    grads = 138_357_544 * 4
    # one node: a ring over the 10 GB/s links; two: the 25 Gb/s network's (halving-doubling or ring: the cheaper)
    assert float(node["comm_ms"]) == pytest.approx((6 * 5e-6 + 1.5 * grads / 10e9) * 1e3, rel=0.05)
    assert float(two["comm_ms"]) == pytest.approx(1.75 * grads * 8 / 25e9 * 1e3, rel=0.05)
    assert float(node["efficiency"]) == pytest.approx(1.0)
    assert float(two["efficiency"]) == pytest.approx(float(node["iteration_ms"]) / float(two["iteration_ms"]))


def test_overlap_hides_exchanges_behind_backward(tmp_path):
    none, backward = tmp_path / "none.csv", tmp_path / "backward.csv"
    base = ["--solver", "allreduce", "--model", "resnet50", "--ranks", "64"]
    assert model(*base, "--csv", str(none)).returncode == 0
    assert model(*base, "--overlap", "backward", "--csv", str(backward)).returncode == 0
    (hidden,), (shown,) = (list(csv.DictReader(path.open())) for path in (backward, none))
    assert float(shown["exposed_ms"]) == pytest.approx(float(shown["comm_ms"]))
    assert float(hidden["exposed_ms"]) < 0.5 * float(hidden["comm_ms"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ranks", "0,4"], "--ranks must be whole numbers >= 1"),
        (["--ranks", "four"], "--ranks must be whole numbers separated by commas"),
        (["--solver", "sgd"], "no performance model for solver 'sgd'"),
        (["--model", "vgg"], "unknown model 'vgg'"),
        (["--model", "mlp"], "give --throughput or --step-time for model 'mlp'"),
        (["--network", "ib9"], "unknown network 'ib9'"),
        (["--solver", "allreduce", "--set", "tau=3"], "no chosen solver's model takes 'tau'"),
        (["--solver", "easgd", "--set", "tau=x"], "option 'tau' of solver 'easgd' must be int"),
        (["--calibration", "/nonexistent.csv"], "cannot read sweep CSV /nonexistent.csv"),
        (["--overlap", "half"], "argument --overlap: invalid choice: 'half'"),
        (["--gpus-per-node", "0"], "--gpus-per-node must be >= 1, got 0"),
        (["--intra-bandwidth", "-1"], "--intra-bandwidth must be > 0 GB/s, got -1.0"),
        (["--baseline", "0"], "--baseline must be >= 1 GPU, got 0"),
        (["--model", "vgg16"], "(--gpu h100 has figures for resnet18, resnet50)"),
        (["--solver", "allreduce", "--set", "fusion=some"], "must be one of 'buckets', 'ready', 'cycle', got 'some'"),
        (["--solver", "allreduce", "--set", "cycle_ms=-1"], "cycle_ms must be >= 0, got -1.0"),
        (["--solver", "allreduce", "--set", "negotiation=maybe"], "option 'negotiation' of solver 'allreduce' must be"),
        (["--solver", "kfac", "--set", "inverse_growth=-1"], "inverse_growth must be >= 0, got -1.0"),
        (["--window-calibration", "/nonexistent.csv"], "cannot read bench windows CSV /nonexistent.csv"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, message):
    done = model(*args)
    assert done.returncode == 2
    assert message in done.stderr and done.stderr.count("\n") == 1, done.stderr
