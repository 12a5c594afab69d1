"""What one node did, counted for operators: iterations and their times, chunk bytes per link, waits, errors.

Plain counters the asyncio shell bumps as it carries out the core's actions; ``node/metrics.py`` exposes
them to Prometheus and the heartbeat carries the newest iteration times to the scheduler (which holds
the rates to set them against their min-cut limit). Nothing here imports a metrics library.
"""

from __future__ import annotations

import collections
import dataclasses

RECENT_ITERATIONS = 64
"""Completed iterations whose times a node remembers."""
UNREPORTED_MAX = 32
"""Iteration times held for the next heartbeat at most (older ones are dropped, newest kept)."""


@dataclasses.dataclass
class NodeStats:
    """Cumulative counts since the node started (Prometheus counters are read from these)."""

    iterations: int = 0
    """Iterations this node completed."""
    failed: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """Iterations that failed here, by cause (failed, gone, timeout)."""
    errors: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """Errors by type: link losses, rejected frames, refused trainer requests, policy fetch failures."""
    sent_bytes: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)
    """Peer -> bytes of chunk frames this node put on its link to that peer (a moved frame counts on the
    link it was moved to)."""
    received_bytes: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)
    """Peer -> bytes of chunk frames received from it."""
    trainer_wait_s: float = 0.0
    """Seconds trainers spent waiting for results (a pull that found its iteration unfinished)."""
    trainer_waits: int = 0
    """Pulls that waited."""
    recent: collections.deque[tuple[int, float, int]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=RECENT_ITERATIONS))
    """(iteration, seconds from its start here to its completion, policy version) of the newest iterations."""
    unreported: collections.deque[tuple[int, float]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=UNREPORTED_MAX))
    """(iteration, seconds) not yet carried by a heartbeat."""

    def done(self, iteration: int, seconds: float, version: int) -> None:
        self.iterations += 1
        self.recent.append((iteration, seconds, version))
        self.unreported.append((iteration, seconds))

    def take_unreported(self) -> tuple[tuple[int, float], ...]:
        """The iteration times the scheduler has not been told of, once."""
        out = tuple(self.unreported)
        self.unreported.clear()
        return out
