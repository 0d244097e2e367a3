"""perf/published.py: the model against published tables (docs/studies/performance-model.md)."""

import json
import subprocess
import sys
from pathlib import Path

PERF = Path(__file__).resolve().parents[2] / "perf"


def test_every_published_figure_lies_within_the_models_bounds(tmp_path):
    """Each published efficiency lies between the model with nothing hidden behind backward
    and the model with the backward timeline; SPD-KFAC shortens MPD-KFAC's iteration by
    10-35%, the paper's range."""
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
    assert len(efficiencies) == 4
    for r in efficiencies:
        assert r["model_nothing_hidden"] <= r["published"] <= r["model"], r["case"]
    spd = [r for r in results if r["case"].endswith("against mpd-kfac")]
    assert len(spd) == 2 and all(10 <= r["model"] <= 35 for r in spd), spd
    assert (tmp_path / "table.md").read_text().count("\n") == len(results) + 2
