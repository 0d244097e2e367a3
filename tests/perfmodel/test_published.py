"""perf/published.py: the model against published tables (docs/studies/performance-model.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

PERF = Path(__file__).resolve().parents[2] / "perf"


def test_every_published_figure_lies_within_the_models_bounds(tmp_path):
    """Each published efficiency lies between the model with nothing hidden behind backward
    and the model with the backward timeline (Horovod's loop for Horovod's rows); SPD-KFAC
    shortens MPD-KFAC's iteration by 10-35%, the paper's range."""
    done = subprocess.run(
        [sys.executable, str(PERF / "published.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=PERF,
    )
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    efficiencies = [r for r in results if r["figure"] == "efficiency"]
    assert len(efficiencies) == 10
    for r in efficiencies:
        assert r["model_nothing_hidden"] <= r["published"] <= r["model"], r["case"]
    # Horovod at 128 and 512 GPUs over its own 16-GPU figure, published and modelled alike
    first = {r["case"].split(", ")[1]: r for r in results if r["case"].startswith("Horovod 16 GPUs")}
    scaled = [r for r in results if "from_16" in r]
    assert len(first) == 3 and len(scaled) == 6
    for r in scaled:
        base = first[r["case"].split(", ")[1]]
        assert r["from_16"]["published"] == pytest.approx(100 * r["published"] / base["published"])
        assert r["from_16"]["model"] == pytest.approx(100 * r["model"] / base["model"])
    spd = [r for r in results if "against mpd-kfac" in r["case"]]
    assert len(spd) == 4 and all(10 <= r["model"] <= 35 for r in spd), spd
    assert (tmp_path / "table.md").read_text().count("\n") == len(results) + 2
