"""b as the paper derives it (Corollary 1): fit the power law |U_(l)| <= phi l**alpha, then
b > log2( sqrt(sum r_l) / (2 phi sqrt(sum r_l l**(2 alpha))) * N m + N ) + 1,
with r_l (eq. 4) the probability that the l-th largest index makes the GIA under k draws and
threshold a. The paper fits alpha and phi on round 1's dense updates at a server; here every DC fits
them on round 1's dense sum (divided by N), which all DCs hold identically, so every DC derives the
same b without a server. Both the fit and the sums run on at most ``SAMPLES`` log-spaced ranks, with
the sums weighted by the ranks each sample stands for.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

SAMPLES = 4096


@dataclasses.dataclass(frozen=True)
class PowerLaw:
    """|U_(l)| <= phi * l**alpha for the sorted magnitudes (alpha < 0)."""

    alpha: float
    phi: float


def _ranks(elements: int) -> tuple[np.ndarray, np.ndarray]:
    """Sample ranks (1-based, log-spaced, distinct) and the number of ranks each stands for."""
    ranks = np.unique(np.geomspace(1, elements, num=min(SAMPLES, elements)).round().astype(np.int64))
    edges = np.concatenate([ranks, [elements + 1]])
    return ranks, np.diff(edges).astype(np.float64)


def fit_power_law(update: np.ndarray) -> PowerLaw:
    """Least squares of log |U_(l)| on log l over the nonzero magnitudes; phi lifted to an upper bound."""
    ascending = np.abs(np.asarray(update, dtype=np.float64).reshape(-1))
    ascending.sort()   # in place: one model-sized copy of |U|
    # the positive magnitudes, largest first: a view past the zeros (first) and before the nans (last)
    zeros = int(np.searchsorted(ascending, 0.0, side="right"))
    nans = int(np.count_nonzero(np.isnan(ascending[zeros:])))
    magnitude = ascending[zeros:ascending.size - nans][::-1]
    if magnitude.size < 2:
        raise ValueError("fitting a power law needs at least two nonzero magnitudes")
    ranks, _ = _ranks(magnitude.size)
    x = np.log(ranks.astype(np.float64))
    y = np.log(magnitude[ranks - 1])
    alpha = float(np.polyfit(x, y, 1)[0])
    alpha = min(alpha, -1e-6)
    phi = float(np.max(magnitude[ranks - 1] / ranks.astype(np.float64) ** alpha))
    return PowerLaw(alpha, phi)


def gia_probability(elements: int, alpha: float, k: int, contributors: int, threshold: int,
                    ranks: np.ndarray) -> np.ndarray:
    """r_l (eq. 2-4) at ``ranks``: k draws with p_l proportional to l**alpha, at least a of N voting l."""
    all_ranks = np.arange(1, elements + 1, dtype=np.float64)
    all_ranks **= alpha   # in place, as ``**`` computes it
    total = float(np.sum(all_ranks))
    del all_ranks
    p = ranks.astype(np.float64) ** alpha / total
    q = -np.expm1(k * np.log1p(-np.minimum(p, 1.0 - 1e-16)))  # 1 - (1 - p)**k without cancellation
    r = np.zeros_like(q)
    for j in range(threshold, contributors + 1):
        r += math.comb(contributors, j) * q ** j * (1.0 - q) ** (contributors - j)
    return np.asarray(np.minimum(r, 1.0))


def derive_bits(update: np.ndarray, contributors: int, k: int, threshold: int) -> int:
    """The smallest integer b that Corollary 1 allows for this update (m = its max |U|)."""
    flat = np.asarray(update, dtype=np.float64).reshape(-1)
    law = fit_power_law(flat)
    ranks, weight = _ranks(flat.size)
    r = gia_probability(flat.size, law.alpha, k, contributors, threshold, ranks)
    selected = float(np.sum(weight * r))
    weighted = float(np.sum(weight * r * ranks.astype(np.float64) ** (2 * law.alpha)))
    if selected <= 0 or weighted <= 0:
        raise ValueError("the expected GIA is empty: lower fediac_votes or raise fediac_k")
    peak = float(np.maximum(np.max(flat), -np.min(flat)))   # max |U| without a model-sized |U|
    bound = math.log2(math.sqrt(selected) / (2 * law.phi * math.sqrt(weighted)) * contributors * peak
                      + contributors) + 1
    return math.floor(bound) + 1
