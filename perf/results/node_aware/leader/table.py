"""The A/B of ab.sh as a table: each op's ratio to MPICH's Allreduce, A then B, round by round, per layout.

Run from this directory: `python table.py BEFORE AFTER` (the commits' short hashes in the JSON file names)."""

import json
import sys

before, after = sys.argv[1:3]
for layout in ("n2", "n4", "n8", "2x2", "2x3"):
    runs = {}
    for round_ in (1, 2):
        for side, commit in (("A", before), ("B", after)):
            with open(f"ab-r{round_}-{layout}-{commit}.json") as f:
                runs[side, round_] = json.loads(f.read().strip().splitlines()[-1])["ratios"]
    print(f"\n{layout}: ratio to MPICH's Allreduce, A r1 / B r1 / A r2 / B r2")
    ops = list(runs["A", 1])
    sizes = list(runs["A", 1][ops[0]])
    print(f"{'bytes':>8} " + " ".join(f"{op:>27}" for op in ops))
    for size in sizes:
        cells = []
        for op in ops:
            cells.append(" / ".join(f"{runs[side, r][op][size]:.2f}" for r in (1, 2) for side in ("A", "B")))
        print(f"{size:>8} " + " ".join(f"{c:>27}" for c in cells))
