"""The measured figures ``advise`` rests on, from the EASGD study's results, as package data.

Write-up: docs/studies/easgd-async.md (the study), docs/guide/cli.md (advise). Reads
perf/results/easgd/results.json (perf/easgd.sh) and writes mpisolve/studies.json: per
workload of the study, its computation/communication ratio (the study's own ``advise``
figures), and the median time to the target accuracy of ``allreduce`` and ``ea-wild``
over the seeds both ran. tests/test_advise.py checks that the package data is what this
script derives from the results file::

    python perf/advise_studies.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from launch import RESULTS

SOURCE = RESULTS / "easgd" / "results.json"
STUDY = "docs/studies/easgd-async.md"
OUT = Path(__file__).resolve().parent.parent / "mpisolve" / "studies.json"
SOLVERS = ("allreduce", "ea-wild")


def evidence(results: dict[str, Any]) -> dict[str, Any]:
    """The study's points: one per workload, with both solvers' median times to target."""
    points = []
    for name, workload in sorted(results["workloads"].items()):
        main, figures = workload["pieces"]["main"], workload["advise"]
        times = {
            solver: {
                int(r["seed"]): float(r["time_to_target_s"])
                for r in results["rows"]
                if r["workload"] == name and r["solver"] == solver and r["time_to_target_s"] is not None
            }
            for solver in SOLVERS
        }
        seeds = sorted(set(times["allreduce"]) & set(times["ea-wild"]))
        medians = {solver: statistics.median(times[solver][s] for s in seeds) for solver in SOLVERS}
        points.append(
            {
                "workload": f"{main['model']} on {main['dataset']}, batch {main['batch_size']}, "
                f"{main['device_ms']} ms a sample, {workload['ranks']} ranks",
                "ratio": figures["ratio"],
                "target_accuracy": workload["target_accuracy"],
                "seeds": seeds,
                "median_time_to_target_s": medians,
                "winner": min(SOLVERS, key=lambda solver: medians[solver]),
            }
        )
    return {"study": STUDY, "source": "perf/results/easgd/results.json", "points": points}


def main() -> int:
    written = evidence(json.loads(SOURCE.read_text()))
    OUT.write_text(json.dumps(written, indent=1) + "\n")
    print(json.dumps(written, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
