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


class LentPrograms:
    """Compiled cluster aggregator programs (``bpf.cluster`` loads one per cluster and test, seconds each)
    lent out again and again within one test module, in place of ``XdpAggregator`` in ``bpf.cluster``.

    A program is lent for one layout (the compiled program depends on it) and configured afresh for its
    borrower: upstream, job, port, expected members, timer, and no token check or horizon until the borrower
    asks for one. Its counters read from zero for each borrower, as a fresh program's do. ``close`` detaches
    it and takes it back; ``release`` closes them all. The module must give every test newer iterations than the
    last (a slot is taken over by a newer iteration only), and its cluster programs must not report slots
    (``max_nacks`` 0, as ``bpf.cluster`` configures them), so nothing of one test reaches the next."""

    def __init__(self) -> None:
        self.free: dict[EdgeLayout, list[Any]] = {}
        self.every: list[Any] = []
        self.compiled = 0

    def __call__(self, layout: EdgeLayout, *, job: int, port: int, expected: int, timeout: float,
                 max_nacks: int = 20, upstream: Any = None) -> Any:
        from bpf.xdp import XdpAggregator

        if max_nacks != 0:
            raise AssertionError("a lent program must not report slots into its next borrower's ring buffer")
        free = self.free.setdefault(layout, [])
        if free:
            program = free.pop()
        else:
            program = XdpAggregator(layout, job=job, port=port, expected=expected, timeout=timeout,
                                    max_nacks=max_nacks, upstream=upstream)
            self.compiled += 1
            self.every.append(program)
        program.upstream = upstream   # given back with require_tokens(0): no token check is left on
        program.configure(job=job, port=port, expected=expected, timeout=timeout, max_nacks=max_nacks)
        return _Lent(program, self, layout)

    def give_back(self, program: Any, layout: EdgeLayout) -> None:
        program.detach()
        program.require_tokens(0)
        program.bound(None)   # the next borrower's iterations are newer, but its horizon is its own
        self.free[layout].append(program)

    def release(self) -> None:
        for program in self.every:
            program.close()
        self.every.clear()
        self.free.clear()


class _Lent:
    """A lent program as its borrower sees it: counters from zero, and ``close`` gives it back."""

    def __init__(self, program: Any, owner: LentPrograms, layout: EdgeLayout) -> None:
        self._program = program
        self._owner = owner
        self._layout = layout
        self._base = program.stats()

    def stats(self) -> dict[str, int]:
        return {name: value - self._base.get(name, 0) for name, value in self._program.stats().items()}

    def close(self) -> None:
        if self._program is not None:
            self._owner.give_back(self._program, self._layout)
            self._program = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._program, name)
