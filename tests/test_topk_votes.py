"""Top-k's vote by partition is the stable sort's: the k largest |U|, ties to the lower index, whatever the
values (hypothesis: ties, zeros of both signs, infinities, NaN)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from netstorm.compression.voting import top_votes


def by_sort(update: np.ndarray, k: int) -> np.ndarray:
    magnitude = np.abs(update)
    votes = np.zeros(magnitude.size, np.uint8)
    votes[np.argsort(-magnitude, kind="stable")[:max(0, min(k, magnitude.size))]] = 1
    return votes


values = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, -2.5, 1e-30, 3.0, float("inf"), -float("inf")])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(values, st.floats(-10, 10, width=32)), max_size=60), st.integers(-1, 70),
       st.booleans())
def test_the_partition_vote_is_the_stable_sorts(items: list[float], k: int, nan: bool) -> None:
    update = np.array(items + ([float("nan")] if nan else []), np.float32)
    np.testing.assert_array_equal(top_votes(update, k), by_sort(update, k))
