"""What the gateway sends its LAN, in what order and how fast (sans-I/O).

See docs/ARCHITECTURE.md, *The LAN tier*."""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

Address = tuple[str, int]


@dataclass(frozen=True)
class Batch:
    """Datagrams for one destination, ready for one send: ``count`` datagrams of ``size`` bytes each in
    ``data`` (one datagram when ``count`` is 1; several only for equal sizes, one GSO send)."""

    address: Address
    data: memoryview
    size: int
    count: int
    bulk: bool


@dataclass
class _Burst:
    rows: np.ndarray
    tag: int
    at: int = 0


class Outbox:
    def __init__(self, *, control_limit: int = 1 << 16, batch: int = 64, batch_bytes: int = 65000,
                 control_per_turn: int = 64, keep: int = 1 << 16) -> None:
        if min(batch, batch_bytes, control_per_turn, keep, control_limit) < 1:
            raise ValueError("outbox limits must be positive")
        self.batch = batch
        """Most datagrams in one bulk batch (64: UDP GSO's limit; 1 without GSO)."""
        self.batch_bytes = batch_bytes
        """Most bytes in one bulk batch (one GSO send carries at most an IPv4 datagram's payload)."""
        self.control_limit = control_limit
        self.control_per_turn = control_per_turn
        self.keep = keep
        """Most bulk datagrams queued for one destination (the agent: a few models' worth)."""
        self._control: collections.deque[tuple[bytes, Address]] = collections.deque()
        self._bulk: dict[Address, collections.deque[_Burst]] = {}
        self._queued: dict[Address, int] = {}
        """Bulk datagrams queued per destination."""
        self._order: collections.deque[Address] = collections.deque()
        """Destinations with bulk pending, in round-robin order (the head goes next)."""
        self._rate: dict[Address, float] = {}
        self._allowed: dict[Address, float] = {}
        self._turn = 0
        """Control datagrams sent since the last bulk batch."""
        self.refused_control = 0
        self.dropped_bursts = 0
        self.sent_datagrams = 0
        self.sent_bytes = 0
        self.bulk_queued = 0
        """Bulk datagrams ever queued (results, PULL answers), sent or not yet."""
        self.bulk_bytes_queued = 0
        """Their UDP payload bytes."""

    # ------------------------------------------------------------------ in
    def control(self, datagram: bytes, address: Address) -> bool:
        """Queue one control datagram; False when the queue is full (refused, counted)."""
        if len(self._control) >= self.control_limit:
            self.refused_control += 1
            return False
        self._control.append((datagram, address))
        return True

    def bulk(self, rows: np.ndarray, address: Address, *, tag: int = 0) -> None:
        """Queue ``rows`` (uint8, one datagram per row, kept by reference) for ``address``; ``tag`` names
        the burst (the iteration) for ``forget``."""
        if rows.ndim != 2 or rows.dtype != np.uint8:
            raise ValueError(f"bulk rows must be a 2-D uint8 array, got {rows.dtype} {rows.shape}")
        if not len(rows):
            return
        queue = self._bulk.get(address)
        if queue is None:
            queue = self._bulk[address] = collections.deque()
            self._order.append(address)
        queue.append(_Burst(np.ascontiguousarray(rows), tag))
        self.bulk_queued += len(rows)
        self.bulk_bytes_queued += int(rows.nbytes)
        self._queued[address] = self._queued.get(address, 0) + len(rows)
        while len(queue) > 1 and self._queued[address] > self.keep:
            old = queue.popleft()
            self._queued[address] -= len(old.rows) - old.at
            self.dropped_bursts += 1

    def forget(self, before: int) -> None:
        """Drop bursts tagged below ``before`` not yet (fully) sent: results no worker can still use."""
        for address, queue in list(self._bulk.items()):
            kept = collections.deque(b for b in queue if b.tag >= before)
            self.dropped_bursts += len(queue) - len(kept)
            self._bulk[address] = kept
            self._queued[address] = sum(len(b.rows) - b.at for b in kept)
            if not kept:
                self._drop(address)

    def pace(self, address: Address, bytes_per_s: float | None) -> None:
        """Send bulk to ``address`` no faster than ``bytes_per_s`` (None: as fast as the socket takes it)."""
        if bytes_per_s is None:
            self._rate.pop(address, None)
            self._allowed.pop(address, None)
        elif not bytes_per_s > 0:
            raise ValueError(f"a pace must be positive, got {bytes_per_s!r}")
        else:
            self._rate[address] = float(bytes_per_s)

    # ------------------------------------------------------------------ out
    def next(self, now: float) -> Batch | None:
        """What to send now (not consumed until ``done``); None when nothing may go before ``wake_at``."""
        bulk = self._ready_bulk(now) if (self._turn >= self.control_per_turn or not self._control) else None
        if bulk is not None:
            return bulk
        if self._control:
            datagram, address = self._control[0]
            return Batch(address, memoryview(datagram), len(datagram), 1, bulk=False)
        return self._ready_bulk(now)

    def done(self, batch: Batch, now: float) -> None:
        """``batch`` (the last ``next``) left: consume it and charge its destination's pace."""
        self.sent_datagrams += batch.count
        self.sent_bytes += batch.count * batch.size
        if not batch.bulk:
            self._control.popleft()
            self._turn += 1
            return
        self._turn = 0
        address = batch.address
        queue = self._bulk[address]
        burst = queue[0]
        burst.at += batch.count
        self._queued[address] -= batch.count
        if burst.at >= len(burst.rows):
            queue.popleft()
        rate = self._rate.get(address)
        if rate is not None:
            self._allowed[address] = max(self._allowed.get(address, now), now) + batch.count * batch.size / rate
        self._order.remove(address)
        if queue:
            self._order.append(address)   # round-robin: behind every other destination
        else:
            self._drop(address)

    def wake_at(self, now: float) -> float | None:
        """When ``next`` will have something: ``now`` if it has, the earliest paced destination's time,
        or None with nothing queued."""
        if self._control or any(self._allowed.get(a, now) <= now for a in self._order):
            return now
        return min((self._allowed[a] for a in self._order), default=None)

    @property
    def pending(self) -> int:
        """Datagrams queued (control and bulk)."""
        return len(self._control) + sum(self._queued.values())

    def pending_to(self, address: Address) -> int:
        """Bulk datagrams queued for ``address``."""
        return self._queued.get(address, 0)

    # ------------------------------------------------------------------ internals
    def _ready_bulk(self, now: float) -> Batch | None:
        for address in self._order:
            if self._allowed.get(address, now) > now:
                continue
            burst = self._bulk[address][0]
            count = min(self.batch, max(1, self.batch_bytes // burst.rows.shape[1]), len(burst.rows) - burst.at)
            part = burst.rows[burst.at: burst.at + count]
            return Batch(address, part.reshape(-1).data.cast("B"), int(part.shape[1]), count, bulk=True)
        return None

    def _drop(self, address: Address) -> None:
        self._bulk.pop(address, None)
        self._queued.pop(address, None)
        if address in self._order:
            self._order.remove(address)
