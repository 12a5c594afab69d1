"""Compression of DDP's gradient buckets: FediAC's or top-k's two rounds per bucket piece, error feedback
kept per bucket piece.

Under DDP the natural unit of compression is the bucket its comm hook gets: ``compressed_hook`` hands
each bucket to the ``netstorm`` process group, whose ``Stage`` cuts it into pieces of ``torch_round``
elements and runs each piece through ``netstorm.compression.session.Rounds`` (votes, then values at the
agreed indices). One protocol (one FediAC b, one seed, one vote threshold) serves every bucket; what is
per bucket is the residual, because error feedback must add back the part of *this* bucket's gradient
that was not sent (with ``fediac_gia_reuse``, the kept GIA and m too: a bucket's indices are not
another's). The key is DDP's bucket index with the bucket's size, so a bucket rebuild (new sizes after
the first step) starts fresh residuals instead of adding one layer's leftovers to another's.

Only gradient buckets go through here: DDP's broadcasts and shape checks, and any ``all_reduce`` a user
calls, stay exact. ``BucketRounds`` does no I/O and imports no torch; the stage drives it.
"""

from __future__ import annotations

from collections.abc import Generator

import numpy as np

from netstorm.compression.codecs import CodecState
from netstorm.compression.options import CompressionOptions
from netstorm.compression.session import Rounds, RoundStats, Tensors

Key = tuple[int, ...]


class BucketRounds:
    """The compression protocol of one rank over its round tensor ``name``, residuals per bucket piece."""

    def __init__(self, options: CompressionOptions, name: str, elements: int, seed: int = 0) -> None:
        if not options.sparse:
            raise ValueError(f"bucket rounds are for the sparse methods (fediac, topk), not {options.method}")
        self.name = name
        self.elements = elements
        self.rounds = Rounds(options, {name: np.zeros(elements, dtype=np.float32)}, seed)
        self.states: dict[Key, CodecState] = {}

    def registered(self) -> Tensors:
        """The round tensor and the compression's integer tensors, to register once."""
        return self.rounds.registered({self.name: np.zeros(self.elements, dtype=np.float32)})

    def start(self, contributors: int, node_id: int, applied: int = 0) -> None:
        """After init: see ``Rounds.start``."""
        self.rounds.start(contributors, node_id, applied)

    @property
    def residuals(self) -> dict[Key, np.ndarray]:
        """Each bucket piece's residual (error feedback)."""
        return {key: state.residual for key, state in self.states.items()}

    @property
    def last(self) -> RoundStats:
        return self.rounds.last

    def iteration(self, key: Key, payload: np.ndarray) -> Generator[Tensors, Tensors, np.ndarray]:
        """The rounds for one bucket piece: yields each push, is sent each round's sums, returns the
        decoded sum over every rank (float32, ``elements`` long)."""
        rounds = self.rounds
        codec = rounds.codec
        if codec is not None:  # the dense first round (b derived) leaves nothing behind
            codec.state = self.states.setdefault(key, CodecState.fresh(self.elements))
        result = yield from rounds.iteration({self.name: payload})
        return np.asarray(result[self.name], dtype=np.float32).reshape(-1)
