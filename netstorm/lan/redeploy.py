"""A changed LAN deployment taking effect in a running job, at an iteration boundary, with every sum exact.

See docs/ARCHITECTURE.md, *The LAN tier*."""

from __future__ import annotations

from dataclasses import dataclass, field

from netstorm.lan.deploy import LanTopology

EPOCHS = 1 << 16
"""Epochs wrap at the header word's width (compared for equality only)."""
KEEP_SWITCHES = 16
"""Switches remembered (``epoch_of`` answers for iterations back to the oldest)."""


@dataclass(frozen=True)
class Switch:
    """A deployment change: ``topology`` runs from iteration ``since`` on, under ``epoch``."""

    epoch: int
    topology: LanTopology
    since: int
    previous: LanTopology


def _after(iteration: int, since: int) -> bool:
    """Whether ``iteration`` is ``since`` or later (iterations wrap at 2**32, as on the wire)."""
    return (((iteration - since) + 2**31) & 0xFFFFFFFF) - 2**31 >= 0


@dataclass
class Redeployment:
    """The gateway's deployment and its changes (see the module docstring)."""

    topology: LanTopology
    epoch: int = 0
    since: int | None = None
    """The first iteration the current epoch runs (None: the first deployment, from the start)."""
    pending: LanTopology | None = None
    """A topology waiting for the next released result."""
    hold: float = 0.05
    """Least seconds between two MOVED to one sender (its window of DATA is refused datagram by datagram)."""
    services: dict[int, int] = field(default_factory=dict)
    """Aggregator worker -> the epoch its service last said HELLO under."""
    switches: list[Switch] = field(default_factory=list)
    """The latest switches, oldest first (at most KEEP_SWITCHES)."""
    dropped: int = 0
    """Switches forgotten past KEEP_SWITCHES."""
    _told: dict[tuple[int, int], float] = field(default_factory=dict)
    """(worker, iteration) -> when it was last sent MOVED (pruned to iterations from ``since``)."""

    def propose(self, topology: LanTopology) -> bool:
        """A new plan's topology: held for the next released result when it differs from the current one
        (a proposal equal to the current one cancels a pending change). Whether a change is pending."""
        if topology.workers != self.topology.workers:
            raise ValueError(f"a topology of {topology.workers} workers for a LAN of {self.topology.workers}")
        self.pending = None if topology == self.topology else topology
        return self.pending is not None

    def released(self, iteration: int) -> Switch | None:
        """The result of ``iteration`` goes back now: a pending topology becomes current from the next
        iteration, under the next epoch (the result's datagrams carry it)."""
        if self.pending is None:
            return None
        switch = Switch((self.epoch + 1) % EPOCHS, self.pending, (iteration + 1) & 0xFFFFFFFF, self.topology)
        self.epoch, self.topology, self.since, self.pending = switch.epoch, switch.topology, switch.since, None
        self.switches.append(switch)
        if len(self.switches) > KEEP_SWITCHES:
            del self.switches[0]
            self.dropped += 1
        self._told.clear()
        return switch

    def epoch_of(self, iteration: int) -> int | None:
        """The epoch ``iteration`` runs under: the current one from ``since`` on, an earlier one's back to the
        oldest switch remembered, the first deployment's (0) before every switch; None for an iteration
        before a forgotten switch."""
        for switch in reversed(self.switches):
            if _after(iteration, switch.since):
                return switch.epoch
        if not self.switches:
            return self.epoch
        return (self.switches[0].epoch - 1) % EPOCHS if not self.dropped else None

    def accepts(self, epoch: int) -> bool:
        """Whether an aggregator takes DATA carrying ``epoch`` (only the current one)."""
        return epoch == self.epoch

    def on_stale(self, worker: int, iteration: int, epoch: int, now: float) -> bool:
        """DATA of ``worker`` for ``iteration`` carrying ``epoch`` was refused by an aggregator: whether to
        answer it with MOVED now. Not for the current epoch (nothing to tell), not for an iteration before
        the switch (a late copy of a summed iteration), and once per sender, iteration and ``hold``."""
        if epoch == self.epoch or (self.since is not None and not _after(iteration, self.since)):
            return False
        key = (worker, iteration & 0xFFFFFFFF)
        if now - self._told.get(key, float("-inf")) < self.hold:
            return False
        self._told[key] = now
        if len(self._told) > 4 * 64:
            for old in sorted(self._told, key=self._told.__getitem__)[: len(self._told) // 2]:
                del self._told[old]
        return True

    def on_service_hello(self, head: int) -> bool:
        """Aggregator ``head``'s service said HELLO now (under the current epoch); whether it aggregates a
        cluster in it (else it stands by)."""
        self.services[head] = self.epoch
        return head in self.topology.clusters

    def member_ready(self, worker: int) -> bool:
        """Whether ``worker``'s HELLO can be answered: it sends to the gateway, or its cluster's aggregator
        service said HELLO under the current epoch."""
        head = self.topology.aggregator_of(worker)
        return head is None or self.services.get(head) == self.epoch
