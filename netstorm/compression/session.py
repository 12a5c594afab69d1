"""A job's compression on the trainer side: which tensors to register, and the rounds of one iteration.

See docs/ARCHITECTURE.md, *Compression*."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Generator, Mapping
from typing import Any, Literal, Protocol

import numpy as np

from netstorm.compression import bitwidth, quantize
from netstorm.compression.codecs import Checkpoint, FediacCodec, TopkCodec, ValueRound
from netstorm.compression.options import SCALE, VALUES, VOTES, CompressionOptions

DERIVED_BITS_MAX = 16
"""A derived b is capped here: the values are registered as int16 before b is known (an int32 lane
would double their frames); the paper's bound lands at 12-14 bits at ResNet-18 scale. A larger b is
set with ``fediac_bits``; ``Rounds.derived_bits`` keeps what Corollary 1 asked for."""

Tensors = dict[str, np.ndarray]
Round = Generator[Tensors, Tensors, Tensors]


@dataclasses.dataclass
class RoundStats:
    """What the last iteration did: its rounds and, for the sparse methods, what the GIA held."""

    round_trips: int = 0
    dense: bool = False
    gia: int = 0
    """Indices agreed on (FediAC's GIA, top-k's union)."""
    bits: int = 0
    bitmap_bytes: int = 0
    """The GIA as a bitmap (d/8 bytes): what FediAC's roots send down a hop for it, per tree."""
    wan_bytes: int = 0
    """Bytes this DC's node queued on WAN links over the iteration's rounds (``Client.wan_bytes``)."""
    round_s: tuple[float, ...] = ()
    """Seconds each round's push_pull took (the vote round first): the vote round trip, measured."""
    reused: bool = False
    """The iteration sent values at a kept GIA without a vote round (``fediac_gia_reuse``)."""


@dataclasses.dataclass(frozen=True)
class Push:
    """Action: push these tensors (one node iteration), then hand their sums to ``Rounds.received``."""

    tensors: Tensors
    keep: tuple[str, ...] | None = None
    """The sums ``received`` reads (None: all); a client may hand back only these."""


@dataclasses.dataclass(frozen=True)
class Done:
    """Action: the iteration is over; ``tensors`` is the decoded sum (the mean when asked for)."""

    tensors: Tensors


Action = Push | Done
Phase = Literal["idle", "plain", "dense", "votes", "values"]


class Rounds:
    """The compression protocol of one DC's trainer; see the module docstring."""

    def __init__(self, options: CompressionOptions, model: Mapping[str, np.ndarray], seed: int = 0) -> None:
        self.options = options
        self.names = sorted(model)
        self.shapes = {name: np.asarray(model[name]).shape for name in self.names}
        self.sizes = [int(np.prod(self.shapes[name], dtype=np.int64)) for name in self.names]
        self.elements = int(sum(self.sizes))
        self.seed = seed
        self.contributors = 0
        self.codec: FediacCodec | TopkCodec | None = None
        self.bits = options.bits
        self.last = RoundStats()
        self._zeros: Tensors = {}
        self._rng = np.random.default_rng([seed, 0])
        self.derived_bits = 0
        self.applied = 0
        self._phase: Phase = "idle"
        self._average = False
        self._gradients: Mapping[str, np.ndarray] = {}
        self._sent: ValueRound | None = None
        self._checkpoint: Checkpoint | None = None

    # ---- registration -------------------------------------------------------------------------------

    def registered(self, model: Mapping[str, np.ndarray]) -> Tensors:
        """Everything to register: the model's tensors and, for the sparse methods, the integer ones."""
        out = {name: np.asarray(model[name]) for name in self.names}
        if not self.options.sparse:
            return out
        d = self.elements
        # The votes' dtype bounds a single contribution (0 or 1); sums travel as wide as they need.
        out[VOTES] = np.zeros(d, dtype=np.uint8)
        if self.options.spec.quantized:
            out[SCALE] = np.zeros(quantize.SCALE_BUCKETS, dtype=np.uint8)
            lane = quantize.lane_dtype(self.bits or DERIVED_BITS_MAX)
            out[VALUES] = np.zeros(d, dtype=lane)
        else:
            out[VALUES] = np.zeros(d, dtype=np.float32)
        # np.zeros, not zeros_like: untouched pages cost no memory, and pushing them reads the zero page
        self._zeros = {name: np.zeros(value.shape, dtype=value.dtype) for name, value in out.items()}
        return out

    def init_args(self) -> dict[str, Any]:
        """The keywords of the node client's ``init`` for this compression."""
        return {"compression": self.options.method, "votes": self.options.votes, "bits": self.options.bits,
                "gia_reuse": self.options.gia_reuse}

    def start(self, contributors: int, node_id: int, applied: int = 0) -> None:
        """After init: the contributor count N (every DC's trainer and LAN workers), this DC's id, and the
        threshold the roots apply to the vote counts (0: none, this DC applies it)."""
        self.contributors = contributors
        self.applied = applied
        if not self.options.sparse:
            return
        rng = np.random.default_rng([self.seed, node_id])
        k = self.options.k_of(self.elements)
        if not self.options.spec.quantized:
            self.codec = TopkCodec(self.elements, k=k)
        elif self.bits:
            self._fediac(rng)
        else:
            self._rng = rng

    def joined(self, client: Any, result: Mapping[str, np.ndarray]) -> Tensors:
        """``start`` from a node client that has just returned ``result`` from ``init``; the model's part."""
        self.start(client.num_workers, client.node_id, int(getattr(client, "gia_threshold", 0)))
        return {name: result[name] for name in self.names}

    def _fediac(self, rng: np.random.Generator) -> None:
        # counts the roots already thresholded come back as the 0/1 GIA: a threshold of 1 reads it
        threshold = 1 if self.applied else self.options.votes_of(self.contributors)
        self.codec = FediacCodec(self.elements, contributors=self.contributors,
                                 k=self.options.k_of(self.elements), threshold=threshold, bits=self.bits, rng=rng,
                                 reuse=self.options.gia_reuse)

    # ---- one iteration: events in, actions out ------------------------------------------------------

    def begin(self, gradients: Mapping[str, np.ndarray], *, average: bool = False) -> Action:
        """Start an iteration with this DC's ``gradients``: the first push."""
        if self._phase != "idle":
            raise RuntimeError(f"begin() during an iteration (waiting for the {self._phase} round's sums)")
        self.last = RoundStats()
        self._average = average
        if not self.options.sparse:
            self._phase = "plain"
            return Push({name: np.asarray(gradients[name]) for name in self.names})
        if self.codec is None:  # fediac with b derived: one dense round first
            self._phase = "dense"
            push = dict(self._zeros)
            push.update({name: np.asarray(gradients[name], dtype=np.float32) for name in self.names})
            return Push(push)
        codec = self.codec
        flat = self._flatten(gradients, narrow=True)
        push = dict(self._zeros)
        self._checkpoint = codec.checkpoint()
        if isinstance(codec, FediacCodec) and not codec.must_vote():
            sent, histogram = codec.reused(flat)
            self._phase, self._sent = "values", dataclasses.replace(sent, values=sent.values[:0])
            self.last.reused = True
            push[VALUES] = sent.values.astype(self._zeros[VALUES].dtype, copy=False)
            push[SCALE] = histogram
            return Push(push, (VALUES, SCALE))
        phase1 = codec.votes(flat)
        push[VOTES] = phase1.votes
        if isinstance(codec, FediacCodec):
            push[SCALE] = phase1.scale
        self._phase = "votes"
        return Push(push, (VOTES, SCALE))

    def received(self, result: Mapping[str, np.ndarray], *, seconds: float = 0.0, wan_bytes: int = 0) -> Action:
        """The sums of the last push (and, for the stats, how long its round took and the WAN bytes the
        node queued for it): the next push, or the iteration's result."""
        last = self.last
        last.round_trips += 1
        last.round_s = (*last.round_s, seconds)
        last.wan_bytes += wan_bytes
        phase, self._phase = self._phase, "idle"
        if phase == "plain":
            return self._done({name: result[name] for name in self.names})
        if phase == "dense":
            return self._done(self._derive(result))
        codec = self.codec
        if codec is None or phase == "idle":
            raise RuntimeError("received() outside an iteration")
        if phase == "votes":
            counts = np.asarray(result[VOTES])
            agreed = (codec.values(counts, np.asarray(result[SCALE])) if isinstance(codec, FediacCodec)
                      else codec.values(counts))
            push = dict(self._zeros)
            push[VALUES] = agreed.values.astype(self._zeros[VALUES].dtype, copy=False)
            # the decode needs only the GIA and the factor: the model-sized values go with the push alone
            self._phase, self._sent = "values", dataclasses.replace(agreed, values=agreed.values[:0])
            return Push(push, (VALUES,))
        sent, self._sent = self._sent, None
        if sent is None:
            raise RuntimeError("the values round's sums without its push")
        if last.reused and isinstance(codec, FediacCodec):
            codec.observed(np.asarray(result[SCALE]))
        decoded = codec.decode(np.asarray(result[VALUES]), sent)
        last.gia, last.bits, last.bitmap_bytes = int(sent.gia.size), self.bits, math.ceil(self.elements / 8)
        return self._done(self._unflatten(decoded))

    def abort(self) -> None:
        """The iteration's last push failed (its sums will never come): undo it (see the module
        docstring), so the next ``begin`` starts afresh. Also after a ``begin`` or ``received`` that
        raised midway (the checkpoint is dropped only when the iteration is done). Nothing to do when no
        iteration runs."""
        self._phase, self._sent = "idle", None
        if self.codec is not None and self._checkpoint is not None:
            self.codec.rollback(self._checkpoint)
        self._checkpoint = None

    def underive(self) -> None:
        """Forget the b that a dense round derived (``fediac_bits = 0``), for a caller that undoes a done
        iteration as part of a larger one that failed: DDP's bucket whose dense first piece came back
        and whose next piece failed never reached the trainer (``torch/compressed.py``). The next
        ``begin`` is the dense round again, as in a run without the failed bucket. Call it between
        iterations, after rolling back what the derived codec did."""
        if not self.options.spec.quantized or self.options.bits or self.codec is None:
            return
        self.codec, self.bits, self.derived_bits = None, self.options.bits, 0

    def iteration(self, gradients: Mapping[str, np.ndarray]) -> Round:
        """The core as a generator: yields what to push in each round, is sent each round's sums, returns
        the decoded sum."""
        action = self.begin(gradients)
        while isinstance(action, Push):
            action = self.received((yield action.tensors))
        return action.tensors

    def _done(self, tensors: Tensors) -> Done:
        self._checkpoint = None  # decoded: nothing of this iteration to undo any more
        return Done(_averaged(tensors, self.contributors if self._average else 0))

    def _derive(self, result: Mapping[str, np.ndarray]) -> Tensors:
        """The dense first round's sum, and b derived from it (the same at every DC)."""
        summed = {name: np.asarray(result[name]) for name in self.names}
        mean = self._flatten(summed)
        mean /= max(1, self.contributors)   # in place: one model-sized float64 vector, not two
        threshold = self.options.votes_of(self.contributors)
        least = math.floor(math.log2(self.contributors)) + 2  # 2**(b-1) > N
        try:
            derived = bitwidth.derive_bits(mean, self.contributors, self.options.k_of(self.elements), threshold)
        except ValueError:  # a zero or constant update: nothing to fit; the lane's own width
            derived = 16
        self.bits = max(least, min(DERIVED_BITS_MAX, derived))
        self.derived_bits = derived
        self._fediac(self._rng)
        self.last.dense, self.last.bits = True, self.bits
        return summed

    def _flatten(self, tensors: Mapping[str, np.ndarray], *, narrow: bool = False) -> np.ndarray:
        """The tensors as one float64 vector, each cast into its place (no float64 copy per tensor). With
        ``narrow``, float32 tensors stay float32: the codecs add it to their float64 residual, which
        casts it exactly, and the model-sized vector takes half the memory."""
        arrays = [np.asarray(tensors[name]) for name in self.names]
        wide = not narrow or any(array.dtype != np.float32 for array in arrays)
        flat = np.empty(sum(self.sizes), dtype=np.float64 if wide else np.float32)
        start = 0
        for array, size in zip(arrays, self.sizes, strict=True):
            flat[start:start + size] = array.reshape(-1)
            start += size
        return flat

    def _unflatten(self, flat: np.ndarray) -> Tensors:
        out: Tensors = {}
        start = 0
        for name, size in zip(self.names, self.sizes, strict=True):
            # views of one float32 vector (the codecs decode to float32): no second copy of the model
            out[name] = flat[start:start + size].reshape(self.shapes[name]).astype(np.float32, copy=False)
            start += size
        return out


class _Client(Protocol):
    num_workers: int
    node_id: int

    def init(self, tensors: Mapping[str, np.ndarray], *, compression: str = ...,
             votes: int = ..., bits: int = ..., gia_reuse: int = ...) -> dict[str, np.ndarray]: ...

    def push_pull(self, tensors: Mapping[str, np.ndarray], average: bool = ...) -> dict[str, np.ndarray]: ...


class _AsyncClient(Protocol):
    num_workers: int
    node_id: int

    async def init(self, tensors: Mapping[str, np.ndarray], *, compression: str = ...,
                   votes: int = ..., bits: int = ..., gia_reuse: int = ...) -> dict[str, np.ndarray]: ...

    async def push_pull(self, tensors: Mapping[str, np.ndarray], average: bool = ...) -> dict[str, np.ndarray]: ...


class _Shell:
    """What both shells share: the core, its stats, and the underlying client's identity."""

    client: Any

    def __init__(self, client: Any, options: CompressionOptions, seed: int = 0) -> None:
        self.client = client
        self.options = options
        self.seed = seed
        self.rounds: Rounds | None = None

    @property
    def last(self) -> RoundStats:
        return self._need_rounds().last

    @property
    def num_workers(self) -> int:
        """Contributors to each sum (the underlying client's count)."""
        return int(self.client.num_workers)

    @property
    def node_id(self) -> int:
        return int(self.client.node_id)

    def _need_rounds(self) -> Rounds:
        if self.rounds is None:
            raise RuntimeError("call init before push_pull")
        return self.rounds

    def _wan_bytes(self) -> int:
        return int(getattr(self.client, "wan_bytes", 0))


class CompressedClient(_Shell):
    """``init`` and ``push_pull`` of a ``netstorm.Client`` with the job's compression applied."""

    client: _Client

    def init(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        rounds = self.rounds = Rounds(self.options, tensors, self.seed)
        return rounds.joined(self.client, self.client.init(rounds.registered(tensors), **rounds.init_args()))

    def push_pull(self, tensors: Mapping[str, np.ndarray], average: bool = False) -> dict[str, np.ndarray]:
        rounds = self._need_rounds()
        action = rounds.begin(tensors, average=average)
        keeps = bool(getattr(self.client, "keeps_results", False))   # netstorm's clients: push_pull(keep=)
        keeping: Any = self.client
        try:
            while isinstance(action, Push):
                began = time.perf_counter()
                result = (keeping.push_pull(action.tensors, keep=action.keep) if keeps and action.keep
                          else self.client.push_pull(action.tensors))
                action = rounds.received(result, seconds=time.perf_counter() - began, wan_bytes=self._wan_bytes())
                del result   # this round's sums, not held through the next round's
        except BaseException:
            rounds.abort()   # the iteration failed everywhere: the next one starts afresh
            raise
        return action.tensors


class AsyncCompressedClient(_Shell):
    """The same over ``netstorm.AsyncClient``."""

    client: _AsyncClient

    async def init(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        rounds = self.rounds = Rounds(self.options, tensors, self.seed)
        return rounds.joined(self.client, await self.client.init(rounds.registered(tensors), **rounds.init_args()))

    async def push_pull(self, tensors: Mapping[str, np.ndarray], average: bool = False) -> dict[str, np.ndarray]:
        rounds = self._need_rounds()
        action = rounds.begin(tensors, average=average)
        keeps = bool(getattr(self.client, "keeps_results", False))   # netstorm's clients: push_pull(keep=)
        keeping: Any = self.client
        try:
            while isinstance(action, Push):
                began = time.perf_counter()
                result = await (keeping.push_pull(action.tensors, keep=action.keep) if keeps and action.keep
                                else self.client.push_pull(action.tensors))
                action = rounds.received(result, seconds=time.perf_counter() - began, wan_bytes=self._wan_bytes())
                del result
        except BaseException:
            rounds.abort()   # the iteration failed everywhere: the next one starts afresh
            raise
        return action.tensors


def _averaged(tensors: Tensors, contributors: int) -> Tensors:
    if not contributors:
        return tensors
    return {name: (value / np.float32(contributors)).astype(value.dtype) for name, value in tensors.items()}
