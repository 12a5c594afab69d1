"""Compiled XDP aggregators shared by the edge test modules of a pytest run (compiling costs seconds).

``shared_program``: tensors 0-2 serve the slot-semantics tests; tensor 3 (2000 chunks of one slot each, far
more timers than a quiet host's slab holds free, see bpf/timer_memory.py) serves the timer link test.

``nack_program``: the 90-chunk gateway program of the NACK modules (test_edge_batched_nacks,
test_edge_cluster_nacks, test_edge_query_nacks). What differs between them (job, port, expected workers,
tokens) is configuration each run installs (``configure``) and removes (``detach``, ``require_tokens(0)``);
the program itself is the same, so it is compiled once. A slot is taken over by a newer iteration only, so
the modules draw their iterations from one rising counter, ``nack_iterations``, in whatever order they run."""

from __future__ import annotations

import atexit
import itertools
from functools import cache
from typing import Any

from netstorm.lan.layout import EdgeLayout

LAYOUT = EdgeLayout((1000, 358, 7, 358 * 2000), (12, 12, 12, 0), lanes=358)
SLOT_TENSORS = (0, 1, 2)
TIMER_TENSOR = 3
JOB = 3
PORT = 9111

NACK_LAYOUT = EdgeLayout.uniform([30000, 1234, 7], scale=16, lanes=357)
"""90 chunks: a loss early or late in them is found by the gateway (a chunk completed after it), a loss of
the last one by the workers' tail probe."""
NACK_SLOT_TIMEOUT = 10.0
"""Far beyond any run of the NACK modules: only the workers' and the gateway's own detection recovers."""
nack_iterations = itertools.count(300, 10)


@cache
def shared_program() -> Any:
    from bpf.xdp import XdpAggregator

    agg = XdpAggregator(LAYOUT, job=JOB, port=PORT, expected=1, timeout=5.0)
    atexit.register(agg.close)
    return agg


@cache
def nack_program() -> Any:
    from bpf.xdp import XdpAggregator

    agg = XdpAggregator(NACK_LAYOUT, job=0, port=0, expected=1, timeout=NACK_SLOT_TIMEOUT)
    atexit.register(agg.close)
    return agg
