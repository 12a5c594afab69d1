"""Userspace aggregation with the XDP program's semantics, for hosts where XDP cannot load.

A sans-I/O core: fed DATA datagrams and a clock, it returns completed AGG datagrams (byte-identical in
layout to what the XDP program passes up) and, from ``expire(now)``, the same slot reports the bpf_timer
callback writes to the ring buffer. The agent (bpf/agent.py) runs it behind an asyncio UDP socket.
Sums are int64 in numpy, so overflow is detected exactly and flagged like the kernel path does. Tokens
are checked like the kernel checks them: against the values the agent installed per (worker, iteration).
Slots are the same pool (a newer key takes a slot over, an older one is a straggler and dropped), and
narrow-precision lanes are converted to int32 fixed point at the datagram's scale exactly as the kernel
does (netstorm/lan/precision.py). With ``upstream`` (a cluster aggregator in userspace) a completed slot
becomes this aggregator's DATA for the gateway, as the XDP program's forwarding makes it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from netstorm.lan.errors import StaleDeployment, WireError
from netstorm.lan.fixedpoint import INT32_MAX
from netstorm.lan.header import (
    DATA_PRECISIONS,
    HEADER_BYTES,
    HEADER_DTYPE,
    HEADER_STRUCT,
    MAGIC,
    NEED_NONE,
    VERSION,
    Flag,
    Kind,
    Precision,
)
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.precision import to_fixed
from netstorm.lan.slots import STATS, TOKEN_WINDOW, SlotEvent, slot_dtype

_PRECISIONS = {int(p): p for p in DATA_PRECISIONS}


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

    def __init__(self, layout: EdgeLayout, *, job: int, expected: int, timeout: float, max_nacks: int = 20,
                 up_worker: int | None = None) -> None:
        self.layout = layout
        self.up_worker = up_worker
        """A cluster aggregator's worker id at the gateway: completed slots come out as its DATA (None: AGG)."""
        self.up_tokens: dict[int, int] = {}
        """iteration -> this aggregator's own token at the gateway (with tokens)."""
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
        self.epoch = 0
        """The deployment epoch DATA must carry (netstorm/lan/redeploy.py); other DATA raises StaleDeployment."""
        self.horizon: int | None = None
        """The newest iteration whose DATA is summed (``bound``; None: any)."""

    def require_tokens(self, agg_token: int) -> None:
        """As XdpAggregator.require_tokens."""
        self.agg_token = agg_token

    def redeploy(self, *, expected: int, epoch: int) -> None:
        """As XdpAggregator.redeploy: the contributors expected and the epoch DATA must carry from now on."""
        self.expected = expected
        self.epoch = epoch

    def stats(self) -> dict[str, int]:
        """As XdpAggregator.stats."""
        return dict(self.counters)

    def bound(self, horizon: int | None) -> None:
        """Sum DATA of no iteration newer than ``horizon`` from now on (None: of any); newer DATA is dropped and
        counted (``future``) before it touches a slot, as the XDP program does."""
        self.horizon = horizon

    def install_tokens(self, entries: list[tuple[int, int, int]]) -> None:
        """As XdpAggregator.install_tokens: (worker, iteration, token) into the worker's window."""
        for worker, iteration, token in entries:
            self._tokens[worker * TOKEN_WINDOW + (iteration & (TOKEN_WINDOW - 1))] = (iteration & 0xFFFFFFFF, token)

    def on_data(self, data: bytes | bytearray | memoryview, now: float) -> bytes | None:
        """Add one DATA datagram; returns the AGG datagram when it completed its slot (or re-emits it), or,
        as a cluster aggregator, the DATA datagram that carries the cluster's sum on to the gateway."""
        lanes = self.layout.lanes
        if len(data) < HEADER_BYTES:
            self.counters["bad"] += 1
            raise WireError(f"DATA datagram of {len(data)} bytes is shorter than the header")
        (magic, version, kind, job, worker, flags, iteration, tensor, chunk, index, count, scale, need,
         _total, token, precision_code, wscale, epoch) = HEADER_STRUCT.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            raise WireError(f"not an edge datagram (magic 0x{magic:04x}, version {version})")
        if kind != Kind.DATA or job != self.job:
            raise WireError(f"not a DATA datagram of job {self.job}")
        self.counters["rx"] += 1
        precision = _PRECISIONS.get(precision_code)
        if precision is None or len(data) != HEADER_BYTES + precision.lane_bytes * lanes:
            self.counters["bad"] += 1
            raise WireError(f"DATA datagram of {len(data)} bytes at precision code {precision_code}, expected "
                            f"{lanes} lanes")
        if not 0 < count <= lanes or worker >= 64 or index >= len(self.slots) or flags & ~int(Flag.OVERFLOW):
            self.counters["bad"] += 1
            raise WireError(f"DATA from worker {worker} with count {count}, slot {index}: out of range")
        if self.agg_token:
            want = self._tokens.get(worker * TOKEN_WINDOW + (iteration & (TOKEN_WINDOW - 1)))
            if want is None or want != (iteration, token):
                self.counters["bad_token"] += 1
                return None
        if self.horizon is not None and 0 < ((iteration - self.horizon) & 0xFFFFFFFF) < 2**31:
            self.counters["future"] += 1
            return None
        if epoch != self.epoch:
            self.counters["old_epoch"] += 1
            raise StaleDeployment(f"DATA of worker {worker} for iteration {iteration} carries deployment epoch "
                                  f"{epoch}, this aggregator runs {self.epoch}", worker=worker,
                                  iteration=iteration, epoch=epoch)
        bit = 1 << worker
        if not self.expected & bit:
            self.counters["unexpected"] += 1
            return None
        raw = np.frombuffer(data, np.uint8, offset=HEADER_BYTES)
        values = to_fixed(raw, precision, wscale, scale)
        if precision != Precision.FIXED32 and np.any(np.abs(values) > INT32_MAX):
            flags |= int(Flag.OVERFLOW)   # a lane left int32 at this scale, as the kernel's conversion flags it
        s = self.slots[index]
        same = (s.iteration, s.tensor, s.chunk) == (iteration, tensor, chunk)
        age = ((iteration - s.iteration + 2**31) % 2**32) - 2**31
        newer = age > 0 or (age == 0 and (tensor, chunk) > (s.tensor, s.chunk))
        last = add = False
        # contributors the current mask does not expect: the slot filled before the deployment changed
        # (netstorm/lan/redeploy.py); it starts over instead of handing on another cluster's sum
        foreign = s.bitmap & ~self.expected
        if same and scale == s.scale and s.bitmap and not foreign:
            if count != s.count:
                self.counters["bad"] += 1
                raise WireError(f"worker {worker} sent {count} lanes for slot {index}, others sent {s.count}")
            if s.bitmap & bit:
                if s.bitmap != self.expected:
                    self.counters["dup"] += 1
                    s.busy = True   # a slot completed under another mask waits for the rest of this one
                    return None
                if s.busy:   # complete under a mask that shrank since its contributors came
                    s.busy = False
                    self.counters["complete"] += 1
                else:
                    self.counters["reemit"] += 1
                last = True
            else:
                add = True
        elif (same and (scale < s.scale or foreign)) or newer or not s.bitmap:
            if s.busy and not same:
                self.counters["busy_evicted"] += 1
            s.iteration, s.tensor, s.chunk, s.scale, s.count = iteration, tensor, chunk, scale, count
            s.need, s.flags, s.nacks, s.bitmap, s.busy = NEED_NONE, 0, 0, 0, True
            s.lanes[:] = 0
            s.deadline = now + self.timeout
            self._arm(s.deadline, index)
            add = True
        else:
            self.counters["stale" if same or age != 0 else "collision"] += 1
            return None
        if add:
            s.lanes += values
            s.bitmap |= bit
            s.flags |= flags & int(Flag.OVERFLOW)
            s.need = min(s.need, need)
            if s.bitmap == self.expected:
                s.busy = False
                last = True
                self.counters["complete"] += 1
        if not last:
            return None
        if np.any(np.abs(s.lanes) > INT32_MAX):
            s.flags |= int(Flag.OVERFLOW)
            self.counters["overflow"] += 1
        out = bytearray(HEADER_BYTES + 4 * lanes)
        out[:HEADER_BYTES] = bytes(data[:HEADER_BYTES])
        head = np.frombuffer(out, HEADER_DTYPE, count=1)
        head["flags"], head["need"], head["precision"], head["wscale"] = s.flags, s.need, 0, 0
        if self.up_worker is None:
            head["kind"], head["token"] = int(Kind.AGG), self.agg_token
        else:
            head["kind"], head["worker"] = int(Kind.DATA), self.up_worker
            head["token"] = self.up_tokens.get(iteration & 0xFFFFFFFF, 0)
            self.counters["forwarded"] += 1
        out[HEADER_BYTES:] = np.clip(s.lanes, -(2**31), INT32_MAX).astype("<i4").tobytes()
        return bytes(out)

    def slot_states(self, indices: np.ndarray) -> np.ndarray:
        """As XdpAggregator.slot_states: each slot's key, scale, busy flag and contributor bitmap."""
        out = np.zeros(len(indices), slot_dtype(56))
        for row, index in enumerate(np.asarray(indices, np.int64)):
            if 0 <= index < len(self.slots):
                s = self.slots[index]
                out[row] = (s.iteration, s.tensor, s.chunk, s.scale, s.busy, s.bitmap)
        return out

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
