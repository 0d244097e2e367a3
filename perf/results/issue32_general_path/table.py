"""ab.sh's log as a markdown table: per ranks and bytes, each call's median over rounds, before -> after."""

import json
import statistics
import sys
from collections import defaultdict

CALLS = [
    ("mpisolve_allreduce_us", "`mpisolve.allreduce`"),
    ("hvd_broadcast_us", "`hvd.broadcast`"),
    ("mpisolve_broadcast_us", "`mpisolve.broadcast`"),
    ("hvd_allgather_us", "`hvd.allgather`"),
    ("hvd_grouped_allreduce_4_us", "`hvd.grouped_allreduce`, 4 tensors"),
]


def main() -> None:
    runs: dict[tuple[str, int, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    side = ""
    for line in open(sys.argv[1]):
        if line.startswith("# "):
            side = line.split()[1]
        elif line.startswith("{"):
            row = json.loads(line)
            for key, _ in CALLS:
                runs[(side, row["ranks"], row["bytes"])][key].append(row[key])
    print("| ranks | bytes | " + " | ".join(name for _, name in CALLS) + " |")
    print("| --- | --- |" + " --- |" * len(CALLS))
    for ranks, nbytes in sorted({(r, b) for _, r, b in runs}):
        cells = []
        for key, _ in CALLS:
            before = statistics.median(runs[("BASE", ranks, nbytes)][key])
            after = statistics.median(runs[("TRY", ranks, nbytes)][key])
            cells.append(f"{before:.1f} -> {after:.1f} us ({after / before:.2f})")
        print(f"| {ranks} | {nbytes} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
