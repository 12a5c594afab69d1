"""Compression of DDP's gradient buckets: FediAC's or top-k's two rounds per bucket piece, error feedback
kept per bucket piece.

See docs/ARCHITECTURE.md, *Compression*."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Generator, Iterator

import numpy as np

from netstorm.compression.codecs import Checkpoint, CodecState, FediacCodec, TopkCodec
from netstorm.compression.options import CompressionOptions
from netstorm.compression.session import Rounds, RoundStats, Tensors

Key = tuple[int, ...]


@dataclasses.dataclass
class _Piece:
    """A bucket piece begun in the current collective, and how to undo it once decoded."""

    key: Key
    codec: FediacCodec | TopkCodec | None
    """None: the dense first round (b derived), which leaves only b behind."""
    state: CodecState | None = None
    checkpoint: Checkpoint | None = None
    new: bool = False
    """Its state was made by this collective (dropped on undo, as if never seen)."""
    done: bool = False


class BucketRounds:
    """The compression protocol of one rank over its round tensor ``name``, residuals per bucket piece."""

    def __init__(self, options: CompressionOptions, name: str, elements: int, seed: int = 0) -> None:
        if not options.sparse:
            raise ValueError(f"bucket rounds are for the sparse methods (fediac, topk), not {options.method}")
        self.name = name
        self.elements = elements
        self.rounds = Rounds(options, {name: np.zeros(elements, dtype=np.float32)}, seed)
        self.states: dict[Key, CodecState] = {}
        self._pieces: list[_Piece] | None = None
        """The pieces of the collective under way (None outside ``collective``)."""

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
        piece = _Piece(key, codec)
        if codec is not None:  # the dense first round (b derived) leaves only b behind
            piece.new = key not in self.states
            piece.state = codec.state = self.states.setdefault(key, CodecState.fresh(self.elements))
            piece.checkpoint = codec.checkpoint()
        if self._pieces is not None:
            self._pieces.append(piece)
        result = yield from rounds.iteration({self.name: payload})
        piece.done = True
        return np.asarray(result[self.name], dtype=np.float32).reshape(-1)

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """The pieces of one bucket: if the block raises, every piece begun in it is undone, once (see
        the module docstring), and the error goes on."""
        if self._pieces is not None:
            raise RuntimeError("a collective inside a collective: one bucket at a time")
        pieces: list[_Piece] = []
        self._pieces = pieces
        try:
            yield
        except BaseException:
            self._undo(pieces)
            raise
        finally:
            self._pieces = None

    def _undo(self, pieces: list[_Piece]) -> None:
        self.rounds.abort()  # the piece in flight (or whose decode raised): back to before it began
        for piece in reversed([p for p in pieces if p.done]):
            if piece.codec is None:
                self.rounds.underive()
                continue
            assert piece.state is not None and piece.checkpoint is not None
            piece.codec.state = piece.state
            piece.codec.rollback(piece.checkpoint)
        for piece in pieces:
            if piece.new:
                self.states.pop(piece.key, None)
