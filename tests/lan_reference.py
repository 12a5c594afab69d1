"""The exact reference the LAN tests check every sum against, computed as every aggregator computes it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def fixed_point_sum(parts: Sequence[np.ndarray], scale: int) -> np.ndarray:
    """Each contribution rounded to int64 fixed point at ``scale`` (x * 2**scale), summed exactly, and turned
    back into float32 once: the LAN sum of one tensor (the values stay far from int32's range)."""
    total = np.sum([np.rint(p.astype(np.float64) * 2.0**scale).astype(np.int64) for p in parts], axis=0)
    return (total.astype(np.float64) * 2.0**-scale).astype(np.float32)


def fixed_point_sums(contribs: Sequence[Sequence[np.ndarray]], scales: Sequence[int]) -> list[np.ndarray]:
    """Per tensor t, ``fixed_point_sum`` of every worker's tensor t at ``scales[t]``."""
    return [fixed_point_sum([w[t] for w in contribs], scale) for t, scale in enumerate(scales)]
