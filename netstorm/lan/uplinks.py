"""Each LAN worker's achieved uplink rate, measured passively from the DATA the gateway already receives
(sans-I/O: datagrams and their arrival times in, bursts out).

Per iteration and worker it keeps the bytes, the first and the last arrival of the worker's first window
of chunks (sequence numbers below the slot pool): a worker sends those back to back, before it waits for
any ACK, so their span measures what its path to the gateway achieved, not how long the other workers
took (the chunks after the first window wait for the ACKs of slots every worker fills). Where every
worker sends at once into the gateway's port, that is the worker's share of that port: an achieved
rate, which is what the planner should see, not a capacity the LAN never gives.

This tracker measures the DATA the agent receives: in userspace mode every worker's, at the gateway (and a
cluster aggregator's contribution, as its own). In XDP mode the kernel aggregates DATA and only aggregates
reach the agent, so the XDP program keeps the same spans itself (bpf/aggregator.c's meter map: a worker's
first pool of datagrams per iteration), which ``XdpAggregator.uplink_spans`` reads back in this form.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Span:
    nbytes: int = 0
    first: float = 0.0
    last: float = 0.0


@dataclass
class UplinkTracker:
    window: int
    """Chunks a worker sends before its first ACK (the slot pool)."""
    keep: int = 8
    """Iterations tracked at once; a datagram of an iteration beyond drops the oldest."""
    _spans: dict[int, dict[int, _Span]] = field(default_factory=dict)

    def on_data(self, worker: int, iteration: int, seq: int, nbytes: int, now: float) -> None:
        """A DATA datagram of ``nbytes`` from ``worker`` for chunk ``seq`` of ``iteration`` arrived at ``now``."""
        if seq >= self.window:
            return
        spans = self._spans.get(iteration)
        if spans is None:
            if len(self._spans) >= self.keep:
                if iteration < min(self._spans):
                    return
                del self._spans[min(self._spans)]
            spans = self._spans[iteration] = {}
        span = spans.get(worker)
        if span is None:
            spans[worker] = _Span(nbytes, now, now)
            return
        span.nbytes += nbytes
        span.first = min(span.first, now)
        span.last = max(span.last, now)

    def close(self, iteration: int) -> list[tuple[int, int, float, float]]:
        """The iteration's bursts, (worker, bytes, first arrival, last arrival), and forget it and older ones."""
        spans = self._spans.pop(iteration, {})
        for old in [k for k in self._spans if k < iteration]:
            del self._spans[old]
        return [(w, s.nbytes, s.first, s.last) for w, s in sorted(spans.items())]
