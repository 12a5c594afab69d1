"""Which model layout a job runs: decided by a quorum of its DCs, never by whichever trainer came first.

Each node's layout check is a vote for the layout hash its trainer registered (a node's newer vote
replaces its older one: a trainer that registered a wrong model and is replaced by a correct one changes
its DC's vote). The layout is adopted once a majority of the job's expected DCs vote for the same hash;
until then a check is answered "pending" and the node asks again. After adoption a check that agrees is
acknowledged at once, and one that disagrees is refused at once (``LayoutMismatch``), so one early
wrong trainer cannot capture the job: it is outvoted, told so, and the job goes on for everyone else.
A layout restored from the scheduler's state, or the only DC of a job, is adopted as it is.

Configured with the job's model (``layout_hash``), there is no vote: the layout is the configured one from
the start, and every check is decided against it at once (a wrong trainer is refused even first, even in a
job of two DCs, where a majority needs both).

No I/O: the scheduler's shell feeds checks and sends the verdicts.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class Verdict:
    """``agreed``: the check matches the adopted layout; otherwise ``mismatch`` says why it is refused,
    or, with neither, the layout is not decided yet (``votes`` of ``needed`` for this hash)."""

    agreed: bool = False
    mismatch: str = ""
    votes: int = 0
    needed: int = 0


class LayoutVote:
    def __init__(self, expected: Iterable[int], adopted: tuple[str, int] | None = None,
                 configured: str = "") -> None:
        self.expected = tuple(sorted(set(expected)))
        self.needed = len(self.expected) // 2 + 1
        """A majority of the expected DCs."""
        self.configured = configured
        """The scheduler's ``layout_hash`` (empty: the majority decides)."""
        self.adopted = adopted
        """(hash, the first node that voted for it, or 0 for the configured layout) once decided."""
        if configured and adopted is not None and adopted[0] != configured:
            raise ValueError(f"the job's layout is {adopted[0]} (first node {adopted[1]}), but layout_hash is "
                             f"{configured}")
        if configured and adopted is None:
            self.adopted = (configured, 0)
        self._votes: dict[int, str] = {}

    def check(self, node_id: int, layout_hash: str) -> Verdict:
        """Node ``node_id``'s trainer registered ``layout_hash``."""
        if self.adopted is None:
            self._votes[node_id] = layout_hash
            count = collections.Counter(v for n, v in self._votes.items() if n in self.expected)[layout_hash]
            if count < self.needed:
                return Verdict(votes=count, needed=self.needed)
            first = min(n for n, v in self._votes.items() if v == layout_hash)
            self.adopted = (layout_hash, first)
        if self.adopted[0] == layout_hash:
            return Verdict(agreed=True)
        how = ("the scheduler's layout_hash" if self.configured else
               f"agreed by a majority of its DCs, first node {self.adopted[1]}")
        return Verdict(mismatch=f"layout mismatch: node {node_id} has layout {layout_hash} but the job's layout is "
                                f"{self.adopted[0]} ({how})")
