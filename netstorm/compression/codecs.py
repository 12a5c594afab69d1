"""One contributor's side of FediAC and of top-k: what it sends in each round and what it keeps.

A codec is pure (no I/O): ``votes`` turns this iteration's update plus the carried residual into the
phase-1 tensors, ``values`` turns the summed counts into the phase-2 tensor, and ``decode`` turns the
summed values back into the sum of every contributor's sent update. The residual (error feedback) is
what this contributor did not send, the rounding error included: after ``values``,
``residual + sent == update + previous residual`` where ``sent`` is what ``decode`` attributes to it.

Both methods send the values at the agreed indices compacted to the front of a model-sized tensor, in
ascending index order, so every contributor's j-th value is the same coordinate and trees add them
element-wise; the node elides the all-zero tail (frames carry only up to the last nonzero element).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from netstorm.compression import quantize, voting


@dataclasses.dataclass(frozen=True)
class VoteRound:
    """Phase 1 out: the vote array and (FediAC) the one-hot of this contributor's max |U|."""

    votes: np.ndarray
    scale: np.ndarray


@dataclasses.dataclass(frozen=True)
class ValueRound:
    """Phase 2 out: values at the GIA, compacted (length = model size, zero beyond ``len(gia)``)."""

    values: np.ndarray
    gia: np.ndarray
    factor: float
    """What the summed values are divided by to decode (f for FediAC, 1 for top-k)."""


class FediacCodec:
    """FediAC (Algorithm 1) for one contributor: sampled votes, global scale, stochastic rounding."""

    def __init__(self, elements: int, *, contributors: int, k: int, threshold: int, bits: int,
                 rng: np.random.Generator) -> None:
        if not 1 <= threshold <= contributors:
            raise ValueError(f"threshold a = {threshold} must be in 1..{contributors} (the contributors)")
        quantize.scale(bits, contributors, 1.0)  # b must leave room for N
        self.elements = elements
        self.contributors = contributors
        self.k = k
        self.threshold = threshold
        self.bits = bits
        self.rng = rng
        self.residual = np.zeros(elements, dtype=np.float64)
        self._update: np.ndarray | None = None

    def votes(self, update: np.ndarray) -> VoteRound:
        """U = update + e; k magnitude-proportional draws; the one-hot of max |U| for the global m."""
        u = np.asarray(update, dtype=np.float64).reshape(-1) + self.residual
        self._update = u
        return VoteRound(voting.sample_votes(u, self.k, self.rng), quantize.scale_histogram(u))

    def values(self, counts: np.ndarray, scale_sum: np.ndarray) -> ValueRound:
        """GIA = counts >= a; theta(f U) at the GIA, compacted; the residual keeps the rest."""
        u = self._need_update()
        gia = voting.consensus(counts, self.threshold)
        peak = quantize.global_peak(scale_sum)
        out = np.zeros(self.elements, dtype=np.int64)
        self.residual = u.copy()
        if peak == 0.0 or gia.size == 0:
            return ValueRound(out, gia, 1.0)
        f = quantize.scale(self.bits, self.contributors, peak)
        rounded = quantize.stochastic_round(f * u[gia], self.rng)
        out[:gia.size] = rounded
        self.residual[gia] = u[gia] - rounded / f
        self._update = None
        return ValueRound(out, gia, f)

    def decode(self, summed: np.ndarray, sent: ValueRound) -> np.ndarray:
        """The sum over contributors of what each sent, dense float32."""
        return _scatter(self.elements, summed, sent)

    def _need_update(self) -> np.ndarray:
        if self._update is None:
            raise ValueError("values() before votes(): phase 2 needs this iteration's update")
        return self._update


class TopkCodec:
    """Plain top-k with error feedback over trees: each contributor votes its own k largest |U|, the
    agreed indices are the union (a = 1), and every contributor sends its float32 values there, so
    sums align; the union holds up to N k indices and costs the same vote round as FediAC."""

    def __init__(self, elements: int, *, k: int) -> None:
        self.elements = elements
        self.k = k
        self.residual = np.zeros(elements, dtype=np.float64)
        self._update: np.ndarray | None = None

    def votes(self, update: np.ndarray) -> VoteRound:
        u = np.asarray(update, dtype=np.float64).reshape(-1) + self.residual
        self._update = u
        return VoteRound(voting.top_votes(u, self.k), np.zeros(0, dtype=np.uint8))

    def values(self, counts: np.ndarray, scale_sum: np.ndarray | None = None) -> ValueRound:
        if self._update is None:
            raise ValueError("values() before votes(): phase 2 needs this iteration's update")
        u = self._update
        union = voting.consensus(counts, 1)
        out = np.zeros(self.elements, dtype=np.float32)
        out[:union.size] = u[union]
        self.residual = u.copy()
        self.residual[union] = u[union] - out[:union.size].astype(np.float64)  # float32 rounding is kept
        self._update = None
        return ValueRound(out, union, 1.0)

    def decode(self, summed: np.ndarray, sent: ValueRound) -> np.ndarray:
        return _scatter(self.elements, summed, sent)


def _scatter(elements: int, summed: np.ndarray, sent: ValueRound) -> np.ndarray:
    out = np.zeros(elements, dtype=np.float32)
    flat = np.asarray(summed).reshape(-1)
    out[sent.gia] = (flat[:sent.gia.size].astype(np.float64) / sent.factor).astype(np.float32)
    return out
