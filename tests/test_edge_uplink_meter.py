"""The XDP program's uplink meter (bpf/aggregator.c's ns_measure, read by XdpAggregator.uplink_spans), run
with BPF_PROG_TEST_RUN: per worker and iteration it counts the bytes of the first window of DATA as sent
(narrow lanes before widening) and their first and last arrival on the kernel's monotonic clock, ignores
workers the gateway does not expect, lets a newer iteration take an entry over and an older one not, and
counts a frame the agent widened in userspace as it arrived (the metadata the agent gives it)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from netstorm.lan.header import Precision
from netstorm.lan.packets import data_packets
from tests.edge_programs import JOB, LAYOUT, PORT, shared_program

pytestmark = [pytest.mark.root, pytest.mark.bcc, pytest.mark.slow]
TENSOR = 0
_iterations = itertools.count(4000, 16)


@pytest.fixture
def agg() -> Iterator[Any]:
    program = shared_program()
    program.configure(job=JOB, port=PORT, expected=0b111, timeout=5.0, max_nacks=3)
    yield program
    program.meter_packets = LAYOUT.num_slots
    program.configure(job=JOB, port=PORT, expected=1, timeout=5.0, max_nacks=3)


def datagrams(worker: int, iteration: int, precision: Precision = Precision.FIXED32) -> np.ndarray:
    values = np.random.default_rng(worker + iteration).standard_normal(LAYOUT.sizes[TENSOR]).astype(np.float32)
    return data_packets(LAYOUT, job=JOB, worker=worker, iteration=iteration, tensor=TENSOR, values=values,
                        precision=precision)


def feed(agg: Any, rows: np.ndarray) -> None:
    from bpf.xdp import udp_frame

    for row in rows:
        agg.test_run(udp_frame(row.tobytes(), dport=PORT))


def test_the_meter_counts_each_expected_workers_bytes_and_arrivals_per_iteration(agg: Any) -> None:
    k = next(_iterations)
    before = time.monotonic()
    sent = {w: datagrams(w, k) for w in (0, 2, 5)}      # worker 5 is not expected: dropped, not counted
    for w in (0, 2, 5):
        feed(agg, sent[w])
    after = time.monotonic()
    spans = agg.uplink_spans(k, 8)
    assert [w for w, *_ in spans] == [0, 2]
    for w, nbytes, first, last in spans:
        assert nbytes == sent[w].nbytes
        assert before <= first < last <= after          # the kernel's clock is time.monotonic's
    assert agg.uplink_spans(k + 1, 8) == []


def test_only_the_first_window_counts_and_iterations_take_entries_over_forwards_only(agg: Any) -> None:
    agg.meter_packets = 2
    agg.configure(job=JOB, port=PORT, expected=0b111, timeout=5.0, max_nacks=3)
    k = next(_iterations)
    rows = datagrams(1, k)
    feed(agg, rows)                                     # three chunks, the window is two
    ((worker, nbytes, *_),) = agg.uplink_spans(k, 8)
    assert (worker, nbytes) == (1, rows[:2].nbytes)
    from netstorm.lan.slots import TOKEN_WINDOW

    later = k + TOKEN_WINDOW                            # the same entry, a newer iteration: taken over
    feed(agg, datagrams(1, later)[:1])
    assert [(w, b) for w, b, *_ in agg.uplink_spans(later, 8)] == [(1, rows[:1].nbytes)]
    feed(agg, rows)                                     # the older iteration again: ignored
    assert agg.uplink_spans(k, 8) == []
    assert [(w, b) for w, b, *_ in agg.uplink_spans(later, 8)] == [(1, rows[:1].nbytes)]


def test_a_frame_widened_by_the_agent_counts_as_it_arrived_narrow(agg: Any) -> None:
    k = next(_iterations)
    narrow = datagrams(2, k, Precision.FP16)
    arrived = [time.monotonic_ns() - 5_000_000 + i for i in range(len(narrow))]
    for row, ns in zip(narrow, arrived, strict=True):
        agg.run_widened(row.tobytes(), arrived_ns=ns)
    ((worker, nbytes, first, last),) = agg.uplink_spans(k, 8)
    assert (worker, nbytes) == (2, narrow.nbytes)       # fp16 lanes: half the bytes the program sums
    assert (first, last) == (arrived[0] * 1e-9, arrived[-1] * 1e-9)
