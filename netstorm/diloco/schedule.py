"""Streaming DiLoCo's fragment schedule: when fragment p is sent, and when its merged result is applied.

Inner steps are counted from 1. Fragment p of P is synchronized after inner step t whenever
t >= o_p and (t - o_p) % H == 0, with the offsets o_p = (p + 1) * H / P spread evenly over every H
steps, so fragment P - 1 is synchronized after steps H, 2H, ... as in DiLoCo. Its merged result is
applied after step t + tau (tau = 0: at once, blocking). tau must stay below H / P so that at most one
fragment is in flight and every sync starts with all earlier ones applied: a DC admitted at a sync
then needs nothing but the global state as it is (``core``'s hand-over).
"""

from __future__ import annotations

import dataclasses

from netstorm.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Schedule:
    """H (``sync_every``), P (``fragments``) and tau (``delay``) of a Streaming DiLoCo run."""

    sync_every: int
    fragments: int = 1
    delay: int = 0

    def __post_init__(self) -> None:
        if self.sync_every < 1 or self.fragments < 1:
            raise ConfigError(f"sync_every and fragments must be >= 1, got {self.sync_every}, {self.fragments}")
        if self.sync_every % self.fragments:
            raise ConfigError(f"sync_every = {self.sync_every} must be a multiple of fragments = {self.fragments}")
        if not 0 <= self.delay < self.spacing:
            raise ConfigError(f"fragment_delay must be in [0, sync_every / fragments = {self.spacing}), "
                              f"got {self.delay}: a fragment's result must be applied before the next one is sent")

    @property
    def spacing(self) -> int:
        """Inner steps between two consecutive fragment syncs (H / P)."""
        return self.sync_every // self.fragments

    def offset(self, fragment: int) -> int:
        """o_p: the first inner step after which ``fragment`` is synchronized."""
        if not 0 <= fragment < self.fragments:
            raise ConfigError(f"fragment {fragment} out of range 0..{self.fragments - 1}")
        return (fragment + 1) * self.spacing

    def sent_after(self, step: int) -> int | None:
        """The fragment synchronized after inner step ``step`` (None: none)."""
        if step < self.spacing or step % self.spacing:
            return None
        return (step // self.spacing - 1) % self.fragments

    def sync_index(self, step: int) -> int:
        """The 0-based count of fragment syncs sent up to and including ``step``."""
        return step // self.spacing - 1

    def sync_step(self, index: int) -> int:
        """The inner step after which sync ``index`` (0-based, all fragments in turn) is sent."""
        return (index + 1) * self.spacing

    def fragment_of(self, index: int) -> int:
        return index % self.fragments

    def applied_after(self, step: int) -> int | None:
        """The sync index whose merged result is applied after inner step ``step`` (None: none)."""
        sent = step - self.delay
        if sent < self.spacing or sent % self.spacing:
            return None
        return self.sync_index(sent)


def fragment_bounds(size: int, fragments: int) -> list[tuple[int, int]]:
    """Fragment p is the contiguous slice [start, stop) of the flattened parameters, all of one size
    ceil(size / P) but the last: one registered tensor of that size carries every fragment's sync, so
    the layout never changes between rounds."""
    if fragments < 1 or size < fragments:
        raise ConfigError(f"{size} parameters cannot form {fragments} fragments")
    width = -(-size // fragments)
    if (fragments - 1) * width >= size:
        raise ConfigError(f"{size} parameters cannot form {fragments} non-empty fragments of {width}")
    return [(p * width, min(size, (p + 1) * width)) for p in range(fragments)]
