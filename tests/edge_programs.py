"""One compiled XDP aggregator shared by the edge test modules of a pytest run (compiling costs seconds).

Tensors 0-2 serve the slot-semantics tests; tensor 3 (2000 chunks of one slot each, far more timers than a
quiet host's slab holds free, see bpf/timer_memory.py) serves the timer link test."""

from __future__ import annotations

import atexit
from functools import cache
from typing import Any

from netstorm.lan.layout import EdgeLayout

LAYOUT = EdgeLayout((1000, 358, 7, 358 * 2000), (12, 12, 12, 0), lanes=358)
SLOT_TENSORS = (0, 1, 2)
TIMER_TENSOR = 3
JOB = 3
PORT = 9111


@cache
def shared_program() -> Any:
    from bpf.xdp import XdpAggregator

    agg = XdpAggregator(LAYOUT, job=JOB, port=PORT, expected=1, timeout=5.0)
    atexit.register(agg.close)
    return agg
