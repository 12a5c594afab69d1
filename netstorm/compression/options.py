"""What a job asks of compression: the method and FediAC's k, b and a, as the config scheme gives them.

The values are the ``compression``, ``fediac_k``, ``fediac_bits``, ``fediac_votes`` and
``fediac_gia_reuse`` options of ``netstorm.config.Config``; the sentinels (0 bits, 0 votes) mean
"derive it as the paper does", which needs the model size and the contributor count, known only after
registration.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from netstorm.compression.methods import COMPRESSION, METHODS, Method
from netstorm.errors import ConfigError

__all__ = ["METHODS", "CompressionOptions", "Method"]
MAX_BITS = 24
"""Widest value lane: the trainer path carries integers as float32, exact up to 2**24."""
PREFIX = "netstorm.compress."
VOTES = PREFIX + "votes"
"""The integer tensor of FediAC's and top-k's vote counts (the one FediAC's roots threshold)."""
SCALE = PREFIX + "scale"
VALUES = PREFIX + "values"

VOTE_SHARE = 0.15
"""Threshold a as a share of the contributors when not given: the paper's a = 3 at N = 20."""


@dataclasses.dataclass(frozen=True)
class CompressionOptions:
    """A job's compression settings (see ``Config``'s Compression section for each field)."""

    method: str = "none"
    """A name of ``netstorm.compression.methods.COMPRESSION``."""
    k: float = 0.05
    """Votes per contributor: a share of the model's elements when below 1, else a count."""
    bits: int = 0
    """Bits b of a quantized value; 0 derives b from a dense first round (the paper's Corollary 1)."""
    votes: int = 0
    """Threshold a: an index joins the GIA with at least this many votes; 0 = ceil(0.15 x contributors)."""
    gia_reuse: int = 1
    """Iterations one FediAC GIA serves (ours; 1 = the paper: a vote round every iteration)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"compression must be one of {', '.join(METHODS)}, got {self.method!r}")

        if not (self.k > 0 and math.isfinite(self.k)) or (self.k >= 1 and not float(self.k).is_integer()):
            raise ConfigError(f"fediac_k must be a share in (0, 1) or a whole count >= 1, got {self.k!r}")
        if self.bits != 0 and not 2 <= self.bits <= MAX_BITS:
            raise ConfigError(f"fediac_bits must be 0 (derived) or 2..{MAX_BITS}, got {self.bits!r}")
        if self.votes < 0:
            raise ConfigError(f"fediac_votes must be >= 0 (0 = derived), got {self.votes!r}")
        if self.gia_reuse < 1:
            raise ConfigError(f"fediac_gia_reuse must be >= 1 (1 = a vote every iteration), got {self.gia_reuse!r}")

    @classmethod
    def of(cls, config: Any) -> CompressionOptions:
        """The options of a ``Config`` (or anything with its compression attributes)."""
        return cls(str(config.compression), float(config.fediac_k), int(config.fediac_bits),
                   int(config.fediac_votes), int(getattr(config, "fediac_gia_reuse", 1)))

    @property
    def spec(self) -> Method:
        """The method's registry entry (what it asks of the rest of the system)."""
        return COMPRESSION.get_entry(self.method)

    @property
    def sparse(self) -> bool:
        """Whether the method votes on indices (two rounds per iteration)."""
        return self.spec.sparse

    def k_of(self, elements: int) -> int:
        """k for a model of ``elements`` values: at least 1, at most all of them."""
        k = round(self.k * elements) if self.k < 1 else int(self.k)
        return max(1, min(elements, k))

    def votes_of(self, contributors: int) -> int:
        """Threshold a for ``contributors`` voters; a method without consensus (top-k) takes the union (a = 1)."""
        if not self.spec.consensus:
            return 1
        if self.votes > contributors:
            raise ConfigError(f"fediac_votes={self.votes} exceeds the {contributors} contributors: the GIA "
                              f"would always be empty")
        return self.votes or max(1, min(contributors, math.ceil(VOTE_SHARE * contributors)))
