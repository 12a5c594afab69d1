"""The first probe round: the links a scenario gives no rate for, measured by their nodes before the
first policy.

Sans-I/O: the shell hands it the registered members and their probe sinks, sends the requests it
makes, feeds it each node's ``ProbeResult``, and plans the first policy from ``rates()`` once it is
``done`` or its deadline passed. A link whose ends cannot probe (no sink, or not registered), whose
probe failed or whose result never came keeps the scenario's prior; ``missing`` says which.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from netstorm import control
from netstorm.scenario import Rates


class ProbeRound:
    """Which directed links are to be measured, by whom, and what came back."""

    def __init__(self, unknown: Collection[tuple[int, int]], prior: Rates, *, members: Mapping[int, tuple[str, int]],
                 sinks: Mapping[int, int], nbytes: int, timeout_s: float, heartbeat_s: float, now: float,
                 deadline_s: float) -> None:
        self.prior = dict(prior)
        self.links = sorted(link for link in unknown
                            if link in self.prior and sinks.get(link[0], 0) > 0 and sinks.get(link[1], 0) > 0
                            and link[0] in members and link[1] in members)
        """The links this round measures (both ends registered with a sink)."""
        self.skipped = sorted(link for link in unknown if link in self.prior and link not in set(self.links))
        """Links with no rate that cannot be probed (an end without a sink): they keep the prior."""
        self.started = now
        self.deadline = now + deadline_s
        self.ended: float | None = None
        """When the first policy was planned from this round (``end``)."""
        self.measured: dict[tuple[int, int], float] = {}
        self.failed: dict[tuple[int, int], str] = {}
        self._waiting = set(members)
        self.requests: dict[int, control.ProbeRequest] = {}
        """Node -> the request it is sent: its outgoing links, none for some; every member is asked, so
        every member heartbeats while the round runs."""
        for src in sorted(self._waiting):
            targets = tuple((dst, members[dst][0], sinks[dst]) for s, dst in self.links if s == src)
            self.requests[src] = control.ProbeRequest(targets=targets, nbytes=nbytes, timeout_s=timeout_s,
                                                      heartbeat_s=heartbeat_s)

    def result(self, message: control.ProbeResult) -> list[str]:
        """A node's result; what in it was not asked for (ignored)."""
        ignored = []
        if message.node_id not in self._waiting:
            return [f"node {message.node_id} was not asked to probe, or answered already"]
        self._waiting.discard(message.node_id)
        for dst, mbit, why in message.rows:
            link = (message.node_id, dst)
            if link not in self.prior or link not in self.links:
                ignored.append(f"link {link[0]}->{link[1]} was not asked for")
            elif mbit > 0:
                self.measured[link] = mbit
            else:
                self.failed[link] = why or "no rate"
        return ignored

    def gone(self, node_id: int) -> None:
        """The node is down: its results will not come."""
        self._waiting.discard(node_id)

    @property
    def done(self) -> bool:
        """Every node asked has answered (or is gone)."""
        return not self._waiting

    @property
    def missing(self) -> list[tuple[int, int]]:
        """Links with no rate that this round did not measure: they keep the prior."""
        return sorted(set(self.skipped) | {link for link in self.links if link not in self.measured})

    def rates(self) -> Rates:
        """The prior with every measured link's rate."""
        return {**self.prior, **self.measured}

    def end(self, now: float) -> None:
        """The round is over (every result in, or the deadline passed): what came is what plans."""
        if self.ended is None:
            self.ended = now

    def record(self) -> tuple[tuple[int, int, float, str], ...]:
        """Once ended, (src, dst, Mbit/s or -1, why not) of every link with no rate: the round's outcome as
        operators and the emulator read it (``Status.probed``); empty while it runs."""
        if self.ended is None:
            return ()
        rows = []
        for link in sorted(set(self.links) | set(self.skipped)):
            if link in self.measured:
                rows.append((*link, self.measured[link], ""))
            else:
                why = self.failed.get(link) or ("no probe sink at an end" if link in self.skipped
                                                else "no result by the deadline")
                rows.append((*link, -1.0, why))
        return tuple(rows)

    @property
    def seconds(self) -> float:
        """How long the round took (-1 while it runs)."""
        return -1.0 if self.ended is None else self.ended - self.started
