"""Adasum in plain numpy float64, in mpisolve's documented order, for the tests' oracles."""

import numpy as np

TINY = np.sqrt(np.finfo(np.float64).tiny)


def pair(a, b):
    """Adasum's rule on two arrays of one shape (float64)."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    dot, na, nb = a @ b, a @ a, b @ b
    ca = 1 - dot / (2 * na) if na >= TINY else 1.0
    cb = 1 - dot / (2 * nb) if nb >= TINY else 1.0
    return ca * a + cb * b


def tree(operands):
    """The first 2(P - k) ranks paired at the bottom (k: the largest power of two <= P),
    then the complete binary tree of adjacent pairs."""
    size = len(operands)
    extra = size - (1 << (size.bit_length() - 1))
    level = [pair(operands[2 * i], operands[2 * i + 1]) for i in range(extra)] + [
        np.asarray(o, np.float64).ravel() for o in operands[2 * extra :]
    ]
    while len(level) > 1:
        level = [pair(level[2 * i], level[2 * i + 1]) for i in range(len(level) // 2)]
    return level[0]
