"""One contributor's side of FediAC and of top-k: what it sends in each round and what it keeps.

See docs/ARCHITECTURE.md, *Compression*."""

from __future__ import annotations

import dataclasses

import numpy as np

from netstorm.compression import quantize, voting


@dataclasses.dataclass
class CodecState:
    """What one contributor carries between iterations of one tensor."""

    residual: np.ndarray
    """Error feedback: what was not sent, rounding error included."""
    gia: np.ndarray | None = None
    """The GIA of the last vote round (kept only when it may be reused)."""
    served: int = 0
    """Iterations the kept GIA has served, its vote's included."""
    peak: float = 0.0
    """The global m of the newest round: the next reused iteration scales by it."""

    @classmethod
    def fresh(cls, elements: int) -> CodecState:
        return cls(np.zeros(elements, dtype=np.float64))


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


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A codec's state and random generator before an iteration (``_Residual.checkpoint``)."""

    state: CodecState
    rng: dict[str, object] | None


class _Residual:
    """The residual of error feedback, kept in the codec's ``state`` (which DDP keeps per bucket piece)."""

    state: CodecState
    _update: np.ndarray | None

    def checkpoint(self) -> Checkpoint:
        """What ``rollback`` restores. Cheap: the rounds replace the residual array, never write into it,
        so a shallow copy of the state keeps the old one."""
        rng = self._generator()
        return Checkpoint(dataclasses.replace(self.state), None if rng is None else dict(rng.bit_generator.state))

    def rollback(self, checkpoint: Checkpoint) -> None:
        """Undo everything since ``checkpoint``: the iteration it preceded failed before its decode. The
        state is restored in place: a caller that keeps states per tensor (DDP's buckets) holds this one."""
        for f in dataclasses.fields(CodecState):
            setattr(self.state, f.name, getattr(checkpoint.state, f.name))
        rng = self._generator()
        if rng is not None and checkpoint.rng is not None:
            rng.bit_generator.state = checkpoint.rng
        self._update = None

    def _generator(self) -> np.random.Generator | None:
        """The codec's random draws (None: it draws nothing)."""
        return None

    @property
    def residual(self) -> np.ndarray:
        return self.state.residual

    @residual.setter
    def residual(self, value: np.ndarray) -> None:
        self.state.residual = value


class FediacCodec(_Residual):
    """FediAC (Algorithm 1) for one contributor: sampled votes, global scale, stochastic rounding."""

    def __init__(self, elements: int, *, contributors: int, k: int, threshold: int, bits: int,
                 rng: np.random.Generator, reuse: int = 1) -> None:
        if not 1 <= threshold <= contributors:
            raise ValueError(f"threshold a = {threshold} must be in 1..{contributors} (the contributors)")
        if reuse < 1:
            raise ValueError(f"a GIA serves at least the iteration of its vote, got reuse = {reuse}")
        quantize.scale(bits, contributors, 1.0)  # b must leave room for N
        self.elements = elements
        self.contributors = contributors
        self.k = k
        self.threshold = threshold
        self.bits = bits
        self.rng = rng
        self.reuse = reuse
        self.state = CodecState.fresh(elements)
        self._update: np.ndarray | None = None

    def _generator(self) -> np.random.Generator | None:
        return self.rng

    def must_vote(self) -> bool:
        """Whether this iteration votes: always at ``reuse = 1`` (the paper), else when the kept GIA has
        served ``reuse`` iterations (or there is none yet)."""
        return self.state.gia is None or self.state.served >= self.reuse

    def votes(self, update: np.ndarray) -> VoteRound:
        """U = update + e; k magnitude-proportional draws; the one-hot of max |U| for the global m."""
        u = self.residual + np.asarray(update).reshape(-1)   # float64: exact cast, no float64 copy
        self._update = u
        return VoteRound(voting.sample_votes(u, self.k, self.rng), quantize.scale_histogram(u))

    def values(self, counts: np.ndarray, scale_sum: np.ndarray) -> ValueRound:
        """GIA = counts >= a; theta(f U) at the GIA, compacted; the residual keeps the rest."""
        u = self._need_update()
        gia = voting.consensus(counts, self.threshold)
        peak = quantize.global_peak(scale_sum)
        if self.reuse > 1:
            self.state.gia, self.state.served, self.state.peak = gia, 1, peak
        return self._quantized(u, gia, peak)

    def reused(self, update: np.ndarray) -> tuple[ValueRound, np.ndarray]:
        """An iteration without a vote (``fediac_gia_reuse``, ours): U = update + e quantized at the kept
        GIA with the m of the previous round, f U clipped to the range that m promised (an update that
        outgrew m cannot overflow the b-bit sum; the clipped part stays in the residual), and the one-hot
        of this U's max |U|, to send with the values, for the next reused iteration's m."""
        if self.state.gia is None:
            raise ValueError("reused() before any vote: there is no GIA to reuse")
        u = self.residual + np.asarray(update).reshape(-1)   # float64: exact cast, no float64 copy
        sent = self._quantized(u, self.state.gia, self.state.peak)
        self.state.served += 1
        return sent, quantize.scale_histogram(u)

    def observed(self, scale_sum: np.ndarray) -> None:
        """The summed one-hots sent with a reused iteration's values: the next one's m."""
        self.state.peak = quantize.global_peak(scale_sum)

    def _quantized(self, u: np.ndarray, gia: np.ndarray, peak: float) -> ValueRound:
        out = np.zeros(self.elements, dtype=np.int64)
        self.residual = u   # this iteration's own array (the old residual, a checkpoint's, is never written)
        self._update = None
        if peak == 0.0 or gia.size == 0:
            return ValueRound(out, gia, 1.0)
        f = quantize.scale(self.bits, self.contributors, peak)
        limit = (2 ** (self.bits - 1) - self.contributors) / self.contributors
        rounded = quantize.stochastic_round(np.clip(f * u[gia], -limit, limit), self.rng)
        out[:gia.size] = rounded
        self.residual[gia] = u[gia] - rounded / f
        return ValueRound(out, gia, f)

    def decode(self, summed: np.ndarray, sent: ValueRound) -> np.ndarray:
        """The sum over contributors of what each sent, dense float32."""
        return _scatter(self.elements, summed, sent)

    def _need_update(self) -> np.ndarray:
        if self._update is None:
            raise ValueError("values() before votes(): phase 2 needs this iteration's update")
        return self._update


class TopkCodec(_Residual):
    """Plain top-k with error feedback over trees: each contributor votes its own k largest |U|, the
    agreed indices are the union (a = 1), and every contributor sends its float32 values there, so
    sums align; the union holds up to N k indices and costs the same vote round as FediAC."""

    def __init__(self, elements: int, *, k: int) -> None:
        self.elements = elements
        self.k = k
        self.state = CodecState.fresh(elements)
        self._update: np.ndarray | None = None

    def must_vote(self) -> bool:
        return True

    def votes(self, update: np.ndarray) -> VoteRound:
        u = self.residual + np.asarray(update).reshape(-1)   # float64: exact cast, no float64 copy
        self._update = u
        return VoteRound(voting.top_votes(u, self.k), np.zeros(0, dtype=np.uint8))

    def values(self, counts: np.ndarray, scale_sum: np.ndarray | None = None) -> ValueRound:
        if self._update is None:
            raise ValueError("values() before votes(): phase 2 needs this iteration's update")
        u = self._update
        union = voting.consensus(counts, 1)
        out = np.zeros(self.elements, dtype=np.float32)
        out[:union.size] = u[union]
        self.residual = u   # this iteration's own array: writing into it leaves a checkpoint's residual alone
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
