"""Userspace aggregation with the XDP program's semantics, for hosts where XDP cannot load.

A sans-I/O core: fed DATA datagrams and a clock, it returns completed AGG datagrams (byte-identical in
layout to what the XDP program passes up) and, from ``expire(now)``, the same slot reports the bpf_timer
callback writes to the ring buffer. The agent (bpf/agent.py) runs it behind an asyncio UDP socket.
Sums are int64 in numpy, so overflow is detected exactly and flagged like the kernel path does. Tokens
are checked like the kernel checks them: against the values the agent installed per (worker, iteration).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from bpf.xdp import STATS, TOKEN_WINDOW, SlotEvent
from netstorm.lan.errors import WireError
from netstorm.lan.fixedpoint import INT32_MAX
from netstorm.lan.header import HEADER_BYTES, HEADER_DTYPE, HEADER_STRUCT, MAGIC, VERSION, Flag, Kind
from netstorm.lan.layout import EdgeLayout


@dataclass
class _Slot:
    iteration: int = 0
    tensor: int = 0
    chunk: int = 0
    scale: int = 0
    count: int = 0
    need: int = 127
    flags: int = 0
    nacks: int = 0
    busy: bool = False
    bitmap: int = 0
    deadline: float = 0.0
    lanes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


class UserspaceAggregator:
    """Slots keyed like the kernel's: one per layout chunk, taken over by newer iterations."""

    def __init__(self, layout: EdgeLayout, *, job: int, expected: int, timeout: float, max_nacks: int = 20) -> None:
        self.layout = layout
        self.job = job
        self.expected = expected
        self.timeout = timeout
        self.max_nacks = max_nacks
        self.slots = [_Slot(lanes=np.zeros(layout.lanes, np.int64)) for _ in range(layout.num_slots)]
        self.counters = dict.fromkeys(STATS, 0)
        self._timers: list[tuple[float, int]] = []
        self._tokens: dict[int, tuple[int, int]] = {}
        """Window entry (worker * TOKEN_WINDOW + iteration % TOKEN_WINDOW) -> (iteration, token)."""
        self.agg_token = 0
        """Nonzero: DATA must carry an installed token, and aggregates carry this value."""

    def require_tokens(self, agg_token: int) -> None:
        """As XdpAggregator.require_tokens."""
        self.agg_token = agg_token

    def install_tokens(self, entries: list[tuple[int, int, int]]) -> None:
        """As XdpAggregator.install_tokens: (worker, iteration, token) into the worker's window."""
        for worker, iteration, token in entries:
            self._tokens[worker * TOKEN_WINDOW + (iteration & (TOKEN_WINDOW - 1))] = (iteration & 0xFFFFFFFF, token)

    def on_data(self, data: bytes | bytearray | memoryview, now: float) -> bytes | None:
        """Add one DATA datagram; returns the AGG datagram when it completed its slot (or re-emits it)."""
        lanes = self.layout.lanes
        if len(data) != HEADER_BYTES + 4 * lanes:
            self.counters["bad"] += 1
            raise WireError(f"DATA datagram of {len(data)} bytes, expected {HEADER_BYTES + 4 * lanes}")
        (magic, version, kind, job, worker, flags, iteration, tensor, chunk, index, count, scale, need,
         _total, token) = HEADER_STRUCT.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            raise WireError(f"not an edge datagram (magic 0x{magic:04x}, version {version})")
        if kind != Kind.DATA or job != self.job:
            raise WireError(f"not a DATA datagram of job {self.job}")
        self.counters["rx"] += 1
        if not 0 < count <= lanes or worker >= 64 or index >= len(self.slots) or flags & ~int(Flag.OVERFLOW):
            self.counters["bad"] += 1
            raise WireError(f"DATA from worker {worker} with count {count}, slot {index}: out of range")
        if self.agg_token:
            want = self._tokens.get(worker * TOKEN_WINDOW + (iteration & (TOKEN_WINDOW - 1)))
            if want is None or want != (iteration, token):
                self.counters["bad_token"] += 1
                return None
        bit = 1 << worker
        if not self.expected & bit:
            self.counters["unexpected"] += 1
            return None
        values = np.frombuffer(data, "<i4", offset=HEADER_BYTES)
        s = self.slots[index]
        same = (s.iteration, s.tensor, s.chunk) == (iteration, tensor, chunk)
        age = ((iteration - s.iteration + 2**31) % 2**32) - 2**31
        last = False
        if same and scale == s.scale and s.bitmap:
            if count != s.count:
                self.counters["bad"] += 1
                raise WireError(f"worker {worker} sent {count} lanes for slot {index}, others sent {s.count}")
            if s.bitmap & bit:
                if s.busy:
                    self.counters["dup"] += 1
                    return None
                self.counters["reemit"] += 1
                last = True
            else:
                s.lanes += values
                s.bitmap |= bit
                s.flags |= flags & int(Flag.OVERFLOW)
                s.need = min(s.need, need)
                if s.bitmap == self.expected:
                    s.busy = False
                    last = True
                    self.counters["complete"] += 1
        elif (same and scale < s.scale) or age > 0 or not s.bitmap:
            if s.busy and not same:
                self.counters["busy_evicted"] += 1
            s.iteration, s.tensor, s.chunk, s.scale, s.count = iteration, tensor, chunk, scale, count
            s.need, s.flags, s.nacks, s.bitmap = need, flags & int(Flag.OVERFLOW), 0, bit
            s.lanes[:] = values
            if bit == self.expected:
                s.busy = False
                last = True
                self.counters["complete"] += 1
            else:
                s.busy = True
                s.deadline = now + self.timeout
                self._arm(s.deadline, index)
        else:
            self.counters["stale" if same or age != 0 else "collision"] += 1
            return None
        if not last:
            return None
        if np.any(np.abs(s.lanes) > INT32_MAX):
            s.flags |= int(Flag.OVERFLOW)
            self.counters["overflow"] += 1
        out = bytearray(data)
        head = np.frombuffer(out, HEADER_DTYPE, count=1)
        head["kind"], head["flags"], head["need"], head["token"] = int(Kind.AGG), s.flags, s.need, self.agg_token
        out[HEADER_BYTES:] = np.clip(s.lanes, -(2**31), INT32_MAX).astype("<i4").tobytes()
        return bytes(out)

    def _arm(self, deadline: float, index: int) -> None:
        """Push a slot's timer. A slot taken over again leaves its older entry behind (skipped at expiry);
        when such entries outnumber the slots, the heap is rebuilt from the live ones, so a stream of
        takeovers cannot grow it beyond twice the slot count."""
        heapq.heappush(self._timers, (deadline, index))
        if len(self._timers) > 2 * len(self.slots) + 16:
            self._timers = [(s.deadline, i) for i, s in enumerate(self.slots) if s.busy]
            heapq.heapify(self._timers)

    def next_deadline(self) -> float | None:
        return self._timers[0][0] if self._timers else None

    def expire(self, now: float) -> list[SlotEvent]:
        """Reports for slots whose period ran out while still missing contributors (then re-armed)."""
        events = []
        while self._timers and self._timers[0][0] <= now:
            deadline, index = heapq.heappop(self._timers)
            s = self.slots[index]
            if deadline != s.deadline or not s.busy or s.bitmap == self.expected or s.nacks >= self.max_nacks:
                continue
            s.nacks += 1
            events.append(SlotEvent(s.iteration, s.tensor, s.chunk, index, s.bitmap, self.expected, self.job,
                                    s.scale, s.nacks))
            self.counters["timer_events"] += 1
            if s.nacks < self.max_nacks:
                s.deadline = now + self.timeout
                heapq.heappush(self._timers, (s.deadline, index))
        return events
