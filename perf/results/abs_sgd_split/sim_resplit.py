"""abs-sgd's adaptive split in simulation: ranks of given true speeds, each round's measured speeds scattered
by a lognormal, the split judged by mpisolve.solvers.speeds.resplit on a full window of 3 rounds at margins
0, 0.1 and 0.2 (RESPLIT_GAIN set for each). Prints the moves in 300 rounds, the mean largest micro-batch and
the mean round time at the true speeds (128 samples; the optimum is printed last).

    python perf/results/abs_sgd_split/sim_resplit.py
"""

import random
import statistics
from collections import deque

from mpisolve.solvers import speeds


def simulate(
    true: list[float], sigma: float, margin: float, rounds: int = 300, seed: int = 0
) -> tuple[int, float, float]:
    speeds.RESPLIT_GAIN = margin
    rng = random.Random(seed)
    split, window, moves, largest, times = [32] * len(true), deque(maxlen=3), 0, [], []
    for _ in range(rounds):
        window.append([t * rng.lognormvariate(0, sigma) for t in true])
        if len(window) == 3:
            new = speeds.resplit(split, window)
            moves += new != split
            split = new
        largest.append(max(split))
        times.append(speeds.round_time(split, true))
    return moves, statistics.mean(largest), statistics.mean(times)


for true in ([1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.8], [1.0, 1.0, 1.0, 0.25]):
    for sigma in (0.1, 0.3):
        cells = []
        for margin in (0.0, 0.1, 0.2):
            moves, largest, time = simulate(true, sigma, margin)
            cells.append(f"margin {margin}: moves {moves:3d} largest {largest:5.1f} time {time:5.1f}")
        print(true, sigma, " | ".join(cells))
print(
    "optimal times:",
    [
        round(speeds.round_time(speeds.proportional_batches(tuple(t), 128), t), 1)
        for t in ([1.0] * 4, [1.0, 1.0, 1.0, 0.8], [1.0, 1.0, 1.0, 0.25])
    ],
)
