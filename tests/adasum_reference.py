"""Adasum in plain numpy float64, in mpisolve's documented order, for the tests' oracles."""

import numpy as np

TINY = np.sqrt(np.finfo(np.float64).tiny)


def pair(a, b, share=0.5):
    """Adasum's rule on two arrays of one shape (float64); ``share``: ``a``'s share of the ranks."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    dot, na, nb = a @ b, a @ a, b @ b
    ca = 1 - share * dot / na if na >= TINY else 1.0
    cb = 1 - (1 - share) * dot / nb if nb >= TINY else 1.0
    return ca * a + cb * b


def tree(operands):
    """The first 2(P - k) ranks paired at the bottom (k: the largest power of two <= P),
    then the complete binary tree of adjacent pairs, each pair weighted by the ranks under its sides."""
    size = len(operands)
    extra = size - (1 << (size.bit_length() - 1))
    level = [(pair(operands[2 * i], operands[2 * i + 1]), 2) for i in range(extra)] + [
        (np.asarray(o, np.float64).ravel(), 1) for o in operands[2 * extra :]
    ]
    while len(level) > 1:
        level = [(pair(a, b, wa / (wa + wb)), wa + wb) for (a, wa), (b, wb) in zip(level[::2], level[1::2])]
    return level[0][0]
