"""Per-tensor counters: their minimum, kept without scanning, is always the true minimum."""

from __future__ import annotations

import numpy as np

from node.counters import Counters


def test_the_minimum_follows_random_steps_and_floors():
    rng = np.random.default_rng(5)
    for size in (1, 2, 7, 50):
        counters = Counters(size, 3)
        shadow = np.full(size, 3)
        for _ in range(400):
            if rng.random() < 0.05:
                floor = int(shadow.min()) + int(rng.integers(0, 3))
                counters.raise_to(floor)
                np.maximum(shadow, floor, out=shadow)
            else:
                key = int(rng.integers(0, size))
                counters.step(key)
                shadow[key] += 1
            assert counters.low == int(shadow.min())
            assert counters.high() == int(shadow.max())
            assert counters.behind() == [int(k) for k in np.flatnonzero(shadow == shadow.min())]
            assert [counters[k] for k in range(size)] == shadow.tolist()
