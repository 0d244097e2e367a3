"""Per-call time of a node-shared round's compiled calls (round_sum, arrival): issue 30's duplicates A/B."""

import sys
import time

import numpy as np

from mpisolve.kernels.slots import SlotRound, arrival, round_sum

STRIDE = 8
numel = int(sys.argv[1]) if len(sys.argv) > 1 else 64
counters = np.zeros(2 * STRIDE, dtype=np.int64)[::STRIDE]
rows, tally_rows = np.ones((2, numel), np.float32), np.zeros((2, 2))
out, tally_out = np.zeros(numel, np.float32), np.zeros(2)
sums = SlotRound(counters, rows, 0, numel, out, tally_rows, tally_out)
run = round_sum(sums)
arrive = arrival(np.ones(numel, np.float32), rows[0], np.zeros(2), tally_rows[0], 0, sums)
counters[1] = 1 << 40  # rank 1 always ahead: every call sums
n = 200_000
for name, call in (("round_sum", lambda seq: run(seq, 0)), ("arrival", arrive)):
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for seq in range(1, n + 1):
            call(seq)
        best = min(best, (time.perf_counter() - start) / n)
    print(f"{name} numel={numel}: {best * 1e9:.0f} ns per call (best of 5 x {n})")
