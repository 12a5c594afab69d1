"""FediAC and top-k codecs against their definitions (the paper's eqs. 1-6 and Algorithm 1)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from netstorm.compression import bitwidth, quantize, voting
from netstorm.compression.codecs import FediacCodec, TopkCodec
from netstorm.compression.options import CompressionOptions
from netstorm.errors import ConfigError


def test_votes_are_k_draws_proportional_to_magnitude() -> None:
    rng = np.random.default_rng(7)
    update = np.array([0.0, 1.0, -2.0, 0.0, 4.0, 1.0])
    hits = np.zeros(update.size)
    trials = 20000
    for _ in range(trials):
        votes = voting.sample_votes(update, 1, rng)
        assert votes.sum() == 1
        hits += votes
    assert hits[0] == hits[3] == 0  # a zero is never drawn
    p = np.abs(update) / np.abs(update).sum()
    sigma = np.sqrt(trials * p * (1 - p))
    assert np.all(np.abs(hits - trials * p) <= 5 * sigma + 1e-9)


def test_votes_with_replacement_set_at_most_k_bits() -> None:
    rng = np.random.default_rng(1)
    update = rng.standard_normal(1000)
    votes = voting.sample_votes(update, 200, rng)
    assert votes.dtype == np.uint8 and set(np.unique(votes)) <= {0, 1}
    assert 0 < votes.sum() <= 200
    assert voting.sample_votes(np.zeros(10), 5, rng).sum() == 0


def test_top_votes_pick_the_largest() -> None:
    update = np.array([0.5, -3.0, 2.0, 0.1, -2.0])
    assert np.flatnonzero(voting.top_votes(update, 2)).tolist() == [1, 2]  # tie 2.0 / -2.0 to the lower index


def test_consensus_is_the_threshold_on_full_counts() -> None:
    counts = np.array([0, 3, 1, 2, 5, 2], dtype=np.uint8)
    assert voting.consensus(counts, 2).tolist() == [1, 3, 4, 5]
    assert voting.consensus(counts, 6).size == 0
    with pytest.raises(ValueError):
        voting.consensus(counts, 0)
    gia = voting.consensus(counts, 2)
    assert voting.unpack_gia(voting.pack_gia(gia, counts.size), counts.size).tolist() == gia.tolist()
    assert len(voting.pack_gia(gia, 1001)) == 126


def test_paper_toy_example() -> None:
    """Fig. 1: votes 11100 and 01110 sum to 12210; threshold 2 keeps indices 2 and 3 (1-based)."""
    counts = np.array([1, 1, 1, 0, 0], np.uint8) + np.array([0, 1, 1, 1, 0], np.uint8)
    assert counts.tolist() == [1, 2, 2, 1, 0]
    assert voting.consensus(counts, 2).tolist() == [1, 2]


def test_count_dtype_holds_every_contributor() -> None:
    assert voting.count_dtype(9) == "uint8"
    assert voting.count_dtype(255) == "uint8"
    assert voting.count_dtype(256) == "int16"
    assert voting.count_dtype(40000) == "int32"


def test_stochastic_rounding_is_unbiased() -> None:
    rng = np.random.default_rng(20240601)
    x = np.array([-2.75, -0.5, 0.1, 0.3333, 1.9, 7.0])
    trials = 40000
    rounded = quantize.stochastic_round(np.tile(x, (trials, 1)), rng)
    assert set(np.unique(rounded[:, 5])) == {7}
    for j, value in enumerate(x):
        assert set(np.unique(rounded[:, j])) <= {math.floor(value), math.ceil(value)}
        frac = value - math.floor(value)
        sigma = math.sqrt(frac * (1 - frac) / trials)
        assert abs(rounded[:, j].mean() - value) <= 5 * sigma + 1e-12


def test_scale_histogram_agrees_on_an_upper_bound_of_the_max() -> None:
    peaks = [3e-4, 0.02, 1.0, 1.0000001, 7.5, 2.0**-90, 1e20]
    for peak in peaks:
        bucket = quantize.magnitude_bucket(peak)
        assert bucket is not None
        edge = quantize.bucket_edge(bucket)
        assert peak <= edge <= peak * 2 ** (1 / quantize.BUCKETS_PER_OCTAVE) * (1 + 1e-12)
    histograms = np.sum([quantize.scale_histogram(np.array([p, -p / 2])).astype(np.int64) for p in peaks], axis=0)
    assert quantize.global_peak(histograms) >= max(peaks)
    assert quantize.global_peak(np.zeros(quantize.SCALE_BUCKETS, np.uint8)) == 0.0
    assert quantize.scale_histogram(np.zeros(3)).sum() == 0


@pytest.mark.parametrize(("bits", "contributors"), [(8, 9), (12, 20), (16, 9), (5, 15)])
def test_b_bit_sums_cannot_overflow(bits: int, contributors: int) -> None:
    """The worst case: every contributor at +m (and at -m) rounds up; the sum stays within b bits."""
    rng = np.random.default_rng(bits)
    peak = 3.7
    f = quantize.scale(bits, contributors, peak)
    worst = np.full((contributors, 1000), peak)
    for sign in (1, -1):
        total = sum(quantize.stochastic_round(sign * f * row, rng) for row in worst)
        assert np.abs(total).max() <= 2 ** (bits - 1)
        assert np.all(np.abs(np.ceil(sign * f * worst)).sum(axis=0) <= 2 ** (bits - 1))
    with pytest.raises(ValueError):
        quantize.scale(4, 8, 1.0)


def test_lane_dtype_holds_b_bits() -> None:
    for bits in range(2, 25):
        lo, hi = quantize.lane_range(quantize.lane_dtype(bits))
        assert lo <= -(2 ** (bits - 1)) and 2 ** (bits - 1) - 1 <= hi


def test_derived_bits_match_corollary_1() -> None:
    """d = 1M, |U_(l)| = l**-1, N = 20, k = 5 % d, a = 4: the bound is b > 11.18, so b = 12."""
    d = 1_000_000
    update = 1.0 / np.arange(1, d + 1, dtype=np.float64)
    np.random.default_rng(3).shuffle(update)
    law = bitwidth.fit_power_law(update)
    assert law.alpha == pytest.approx(-1.0, abs=1e-6)
    assert law.phi == pytest.approx(1.0, rel=1e-6)
    assert bitwidth.derive_bits(update, contributors=20, k=d // 20, threshold=4) == 12


def _round(codecs: list[FediacCodec], updates: list[np.ndarray]) -> tuple[list, np.ndarray]:
    phase1 = [c.votes(u) for c, u in zip(codecs, updates, strict=True)]
    counts = np.sum([p.votes.astype(np.int64) for p in phase1], axis=0)
    scale_sum = np.sum([p.scale.astype(np.int64) for p in phase1], axis=0)
    sent = [c.values(counts, scale_sum) for c in codecs]
    summed = np.sum([s.values for s in sent], axis=0)
    return sent, summed


def test_fediac_round_gia_identical_and_error_feedback_exact() -> None:
    n, d, bits = 5, 4000, 10
    rng = np.random.default_rng(11)
    codecs = [FediacCodec(d, contributors=n, k=200, threshold=2, bits=bits, rng=np.random.default_rng(i))
              for i in range(n)]
    carried = [np.zeros(d) for _ in range(n)]
    for _ in range(3):
        updates = [rng.standard_normal(d) * rng.pareto(1.5, d) for _ in range(n)]
        totals = [u + e for u, e in zip(updates, carried, strict=True)]
        sent, summed = _round(codecs, updates)
        assert all(np.array_equal(s.gia, sent[0].gia) for s in sent)
        assert all(s.factor == sent[0].factor for s in sent)
        assert 0 < sent[0].gia.size < d
        assert np.abs(summed).max() <= 2 ** (bits - 1)
        assert np.all(summed[sent[0].gia.size:] == 0)
        for codec, s, total in zip(codecs, sent, totals, strict=True):
            mine = np.zeros(d)
            mine[s.gia] = s.values[:s.gia.size] / s.factor
            # what was not sent is exactly what is carried (float64 rounding of one subtraction)
            np.testing.assert_allclose(codec.residual + mine, total, rtol=0, atol=1e-12 * np.abs(total).max())
            assert np.all(codec.residual[np.setdiff1d(np.arange(d), s.gia)] ==
                          total[np.setdiff1d(np.arange(d), s.gia)])
        decoded = codecs[0].decode(summed, sent[0])
        want = np.zeros(d)
        want[sent[0].gia] = np.sum([s.values[:s.gia.size] for s in sent], axis=0) / sent[0].factor
        np.testing.assert_allclose(decoded, want.astype(np.float32), rtol=1e-6)
        carried = [c.residual.copy() for c in codecs]


def test_fediac_decode_is_unbiased_at_the_gia() -> None:
    """Averaged over rounds with fresh rounding, the decoded sum at GIA indices is the sum of updates."""
    n, d = 3, 50
    signs = np.where(np.arange(d) % 3 == 0, -1.0, 1.0)
    update = [np.linspace(0.2, 1, d) * signs * (i + 1) for i in range(n)]
    acc = np.zeros(d)
    rounds = 3000
    rng = np.random.default_rng(5)
    for _ in range(rounds):
        codecs = [FediacCodec(d, contributors=n, k=d * 100, threshold=1, bits=6, rng=rng) for _ in range(n)]
        sent, summed = _round(codecs, update)
        assert sent[0].gia.size == d  # with k >> d every index is voted, and a = 1 keeps it
        acc += codecs[0].decode(summed, sent[0])
    f = sent[0].factor
    sigma = math.sqrt(n * 0.25 / rounds) / f
    assert np.abs(acc / rounds - np.sum(update, axis=0)).max() <= 5 * sigma


def test_topk_union_and_error_feedback() -> None:
    d = 100
    a = np.zeros(d)
    a[[3, 10, 50]] = [5.0, -4.0, 0.5]
    b = np.zeros(d)
    b[[10, 70]] = [1.0, 9.0]
    codecs = [TopkCodec(d, k=2), TopkCodec(d, k=2)]
    phase1 = [c.votes(u) for c, u in zip(codecs, (a, b), strict=True)]
    counts = phase1[0].votes.astype(np.int64) + phase1[1].votes
    sent = [c.values(counts) for c in codecs]
    assert sent[0].gia.tolist() == [3, 10, 70]  # the union of {3, 10} and {70, 10}
    summed = sent[0].values + sent[1].values
    assert codecs[0].decode(summed, sent[0])[[3, 10, 70]].tolist() == [5.0, -3.0, 9.0]
    assert np.flatnonzero(codecs[0].residual).tolist() == [50]
    assert np.flatnonzero(codecs[1].residual).tolist() == []


def test_options_validate_and_derive() -> None:
    options = CompressionOptions("fediac", k=0.05)
    assert options.k_of(1000) == 50 and options.votes_of(20) == 3 and options.votes_of(9) == 2
    assert CompressionOptions("topk", k=10).k_of(5) == 5
    assert CompressionOptions("topk", votes=4).votes_of(9) == 1
    with pytest.raises(ConfigError):
        CompressionOptions("gzip")
    with pytest.raises(ConfigError):
        CompressionOptions("fediac", k=1.5)
    with pytest.raises(ConfigError):
        CompressionOptions("fediac", bits=30)
    with pytest.raises(ConfigError):
        CompressionOptions("fediac", votes=10).votes_of(9)
