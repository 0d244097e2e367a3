"""Adasum in plain numpy float64, in mpisolve's documented order, for the tests' oracles."""

import numpy as np

TINY = np.sqrt(np.finfo(np.float64).tiny)


def pair(a, b, count_a=1, count_b=1):
    """Adasum's rule on two arrays of one shape (float64), each side weighed by the nonzero inputs under it."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    dot, na, nb = a @ b, a @ a, b @ b
    share = count_a / (count_a + count_b) if count_a > 0 and count_b > 0 else 0.5
    ca = 1 - share * dot / na if na >= TINY else 1.0
    cb = 1 - (1 - share) * dot / nb if nb >= TINY else 1.0
    return ca * a + cb * b


def tree(operands):
    """The first 2(P - k) ranks paired at the bottom (k: the largest power of two <= P), then the
    complete binary tree of adjacent pairs; each pair's sides weighed by the nonzero inputs under them."""
    leaves = [np.asarray(o, np.float64).ravel() for o in operands]
    level = [(x, int(x @ x >= TINY)) for x in leaves]
    extra = len(level) - (1 << (len(level).bit_length() - 1))
    folded = [
        (pair(a, b, wa, wb), wa + wb) for (a, wa), (b, wb) in zip(level[: 2 * extra : 2], level[1 : 2 * extra : 2])
    ]
    level = folded + level[2 * extra :]
    while len(level) > 1:
        level = [(pair(a, b, wa, wb), wa + wb) for (a, wa), (b, wb) in zip(level[::2], level[1::2])]
    return level[0][0]
