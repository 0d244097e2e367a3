"""A stand-in for ``mpisolve train`` in the job script tests: every rank records what MPI told it.

``python -m mpi4py tests/jobs/standin.py --out DIR``: rank r writes DIR/rank-r.json with
its rank, the world size and the sum of all ranks (one real allreduce), so the test can
tell a 4-rank job from four 1-rank jobs.
"""

import argparse
import json
import os

from mpi4py import MPI

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()
world = MPI.COMM_WORLD
record = {"rank": world.rank, "size": world.size, "rank_sum": world.allreduce(world.rank)}
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"rank-{world.rank}.json"), "w", encoding="utf-8") as f:
    json.dump(record, f)
