"""The edge benchmark's inputs and their exact sums, the same for every path.

Worker ``w``'s gradient of iteration ``k`` comes from its own seeded generator (``(seed, k, w)``), so a
gloo rank in another process draws exactly the values the LAN paths send without any being shipped to
it. Values are clipped to ``bound(workers, scale)`` and quantised to the fixed-point grid (multiples of
2**-scale) before any path sees them: the LAN paths' own quantisation then changes nothing, float32 holds
every value and every partial sum exactly (all stay below 2**(24-scale)), and so each path's result must
equal the int64 reference bit for bit whatever order it adds in.
"""

from __future__ import annotations

import numpy as np


def bound(workers: int, scale: int) -> float:
    """Largest magnitude of a value such that any sum of ``workers`` of them is exact in float32."""
    return (2.0 ** (24 - scale) - 1.0) / workers


def contribution(seed: int, iteration: int, worker: int, elements: int, scale: int, workers: int) -> np.ndarray:
    """Worker ``worker``'s quantised float32 gradient of ``iteration`` in a LAN of ``workers``."""
    raw = np.random.default_rng([seed, iteration, worker]).standard_normal(elements, dtype=np.float32)
    limit = bound(workers, scale)
    clipped = np.clip(raw.astype(np.float64), -limit, limit)
    return (np.rint(clipped * 2.0**scale) * 2.0**-scale).astype(np.float32)


def reference(seed: int, iteration: int, workers: int, elements: int, scale: int) -> np.ndarray:
    """The exact sum over ``workers`` of ``iteration``'s contributions (int64 fixed point), as float32."""
    total = np.zeros(elements, np.int64)
    for w in range(workers):
        total += np.rint(contribution(seed, iteration, w, elements, scale, workers).astype(np.float64)
                         * 2.0**scale).astype(np.int64)
    return (total.astype(np.float64) * 2.0**-scale).astype(np.float32)
