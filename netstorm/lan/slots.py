"""What a LAN aggregator (the XDP program, bpf/aggregator.c, or its userspace twin, bpf/fallback.py) tells the
gateway and what the gateway asks of it: slot reports, slot states, counters, and the port the gateway core
(netstorm/lan/gatewaycore.py) drives it through. The library's half of the boundary: no bcc here."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import numpy as np

from netstorm.lan.header import MAX_WORKERS

STATS = ("rx", "dup", "complete", "stale", "collision", "bad", "unexpected", "overflow", "reemit",
         "timer_events", "busy_evicted", "timer_fail", "report_lost", "bad_token", "forwarded", "widened", "old_epoch",
         "result", "iteration_done", "gap_reports", "future")
"""The aggregator's counters, in the program's ``enum ns_stat`` order."""
TOKEN_WINDOW = 8
"""Iterations per worker the token map holds (a power of two): the agent keeps the ones it may receive."""
GROUP_TOKENS = MAX_WORKERS
"""The token map's window after the workers': the group's tokens, which the RESULTs the program sends
itself carry (``install_tokens`` with this as the worker)."""
ITERATION_DONE = 0xFFFFFFFF
"""A ring-buffer report with this slot says every chunk of its iteration completed in the program (results
mode), not that a slot is missing contributors."""
SLOT_FIELDS = {"names": ["iteration", "tensor", "chunk", "scale", "busy", "bitmap"],
               "formats": ["<u4", "<u4", "<u4", "i1", "u1", "<u8"], "offsets": [20, 24, 28, 34, 38, 48]}
"""Where ``struct ns_slot`` (bpf/slot.h) keeps a slot's key and contributors: after the 16-byte bpf_timer and
the 4-byte bpf_spin_lock; the map value's size comes from the kernel."""


def slot_dtype(itemsize: int) -> np.dtype[Any]:
    """The slot fields a QUERY answer reads, in rows of ``itemsize`` bytes (the map's value size)."""
    spec: Any = {**SLOT_FIELDS, "itemsize": itemsize}
    return np.dtype(spec)


@dataclass(frozen=True)
class SlotEvent:
    """The timer callback's report: a slot that is still missing contributors after its period."""

    iteration: int
    tensor: int
    chunk: int
    slot: int
    bitmap: int
    expected: int
    job: int
    scale: int
    nacks: int

    @cached_property
    def missing(self) -> list[int]:
        left = self.expected & ~self.bitmap
        return [w for w in range(left.bit_length()) if left >> w & 1]


class Aggregator(Protocol):
    """What the gateway core asks of its aggregator: map reads and writes, never a packet."""

    def require_tokens(self, agg_token: int) -> None: ...

    def install_tokens(self, entries: list[tuple[int, int, int]]) -> None: ...

    def bound(self, horizon: int | None) -> None: ...

    def slot_states(self, indices: np.ndarray) -> np.ndarray: ...

    def redeploy(self, *, expected: int, epoch: int) -> None: ...

    def stats(self) -> dict[str, int]: ...
