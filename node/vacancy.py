"""Empty trainer places: which DCs' parts of which iterations will not come, and whom to ask; no I/O.

A DC whose trainer closed or died after the init round, with no replacement yet, cannot contribute: the
first iteration that lacks its part fails as soon as it is under way anywhere, and only that DC decides it
(so an iteration fails at every member or at none, and a replacement that inits takes the next one). Later
iterations wait for a replacement, the node's death or their timeout: ``PeerLost`` tells a trainer to run
again without the lost DC, but a DC whose node lives stays in the policies, and failing each retry at once
would spend the retries of the torch stage and DiLoCo in milliseconds.
It learns that an iteration is under way from a peer's chunk for it, from its own waiters, or from a
member that has it under way and asks for the DC's part (a DC that is a leaf of every tree receives
nothing before its own part is in). The node core (``node/core.py``) holds one ``Vacancies`` and does
the failing; this records the state and answers which asks are due.
"""

from __future__ import annotations

from collections.abc import Collection


class Vacancies:
    """This DC's own empty place, the empty places members told of, and the asks already made."""

    def __init__(self) -> None:
        self.own: str | None = None
        """Why this DC's trainer place is empty (None: every place is taken)."""
        self.spent = False
        """This emptiness already failed an iteration: later ones wait (see the module docstring)."""
        self.peers: dict[int, tuple[int, str]] = {}
        """Member -> (the first iteration its part will not come to, why), as it told."""
        self._asked: set[tuple[int, int]] = set()
        """(member, iteration) whose part was asked for already: once each."""

    def told(self, peer: int, iteration: int, reason: str, filled: bool) -> None:
        """Member ``peer`` said its place is empty from ``iteration`` on (or, ``filled``, taken again)."""
        if filled:
            self.forget(peer)
        else:
            self.peers[peer] = (iteration, reason)

    def forget(self, peer: int) -> None:
        """``peer``'s place is taken again, or ``peer`` is gone altogether (its own failure covers it)."""
        self.peers.pop(peer, None)
        self._asked = {(p, i) for p, i in self._asked if p != peer}

    def asks(self, iteration: int, contributors: Collection[int], oldest: int) -> list[int]:
        """The members to ask for their part of ``iteration``, under way here, that ``contributors`` make
        up: those whose place is empty from ``iteration`` or earlier, not asked yet. Asks for iterations
        before ``oldest`` (over here) are forgotten."""
        due = [peer for peer, (first, _) in sorted(self.peers.items())
               if first <= iteration and peer in contributors and (peer, iteration) not in self._asked]
        if due:
            self._asked = {(p, i) for p, i in self._asked if i >= oldest}
            self._asked.update((peer, iteration) for peer in due)
        return due
