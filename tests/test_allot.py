"""Chunk layout and the allotment of chunks to roots in proportion to their shares."""

from __future__ import annotations

import random

import numpy as np
import pytest

from netstorm.allot import allot_chunks, split_chunks
from netstorm.errors import PolicyError


def test_split_chunks_by_hand():
    assert split_chunks([2500, 1000, 3], 1000) == [1000, 1000, 500, 1000, 3]
    with pytest.raises(PolicyError):
        split_chunks([10], 0)
    with pytest.raises(PolicyError):
        split_chunks([0], 10)


def test_equal_chunks_follow_the_shares_in_order():
    # Deficits worked by hand: each chunk goes to the root furthest below its share so far.
    owners = allot_chunks([10] * 8, {3: 0.25, 1: 0.5, 2: 0.25})
    assert owners == [1, 2, 3, 1, 1, 2, 3, 1]


@pytest.mark.parametrize("seed", range(5))
def test_allotted_sizes_stay_within_one_chunk_of_the_shares(seed):
    rng = random.Random(seed)
    roots = rng.sample(range(100), rng.randint(1, 9))
    raw = {r: rng.random() for r in roots}
    shares = {r: v / sum(raw.values()) for r, v in raw.items()}
    sizes = [rng.randint(1, 1000) for _ in range(rng.randint(50, 400))]
    owners = allot_chunks(sizes, shares)
    assert owners == allot_chunks(sizes, dict(reversed(list(shares.items()))))  # order-free
    got = {r: 0 for r in roots}
    for size, owner in zip(sizes, owners, strict=True):
        got[owner] += size
    total = sum(sizes)
    for r in roots:
        assert abs(got[r] - shares[r] * total) <= max(sizes)
    # Every prefix is spread as well.
    prefix = len(sizes) // 2
    got_prefix = np.zeros(len(roots))
    for size, owner in zip(sizes[:prefix], owners[:prefix], strict=True):
        got_prefix[roots.index(owner)] += size
    expected = np.array([shares[r] for r in roots]) * sum(sizes[:prefix])
    assert np.all(np.abs(got_prefix - expected) <= max(sizes))


def test_zero_share_gets_nothing_and_bad_shares_fail():
    assert set(allot_chunks([5] * 20, {1: 0.0, 2: 1.0})) == {2}
    with pytest.raises(PolicyError):
        allot_chunks([5], {})
    with pytest.raises(PolicyError):
        allot_chunks([5], {1: -1.0, 2: 2.0})
    with pytest.raises(PolicyError):
        allot_chunks([0], {1: 1.0})
