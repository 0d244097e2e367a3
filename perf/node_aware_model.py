"""docs/studies/node-aware.md, "The node level of the performance model": fit and check.

Reads perf/results/node_aware/allreduce_resnet18_n{2,4,8}.json (bench allreduce, one
node; those present, two at least), fits the node level's memory bandwidth and counter-wait cost
(:func:`mpisolve.perfmodel.node.fit_node_memory`) to the node-shared buckets' times, and
writes the fit, and the model's time against the measured one at each rank count, to
perf/results/node_aware/model.json (and prints it).
"""

from __future__ import annotations

import json
from pathlib import Path

from mpisolve.perfmodel.node import fit_node_memory, node_sum

RESULTS = Path(__file__).resolve().parent / "results" / "node_aware"


def main() -> None:
    found = [RESULTS / f"allreduce_resnet18_n{n}.json" for n in (2, 4, 8)]
    runs = [json.loads(path.read_text()) for path in found if path.exists() and path.stat().st_size]
    nbytes = runs[0]["numel"] * 4
    ranks = [r["ranks"] for r in runs]
    seconds = [r["mpisolve_s"] for r in runs]
    mem = fit_node_memory(ranks, nbytes, seconds)
    out = {
        "bytes": nbytes,
        "node_GBps": mem.node_Bps / 1e9,
        "sync_us": mem.sync_s * 1e6,
        "points": [
            {"ranks": p, "measured_ms": t * 1e3, "model_ms": node_sum(mem, p, nbytes) * 1e3}
            for p, t in zip(ranks, seconds)
        ],
    }
    (RESULTS / "model.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
