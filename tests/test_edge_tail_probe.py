"""The worker's tail probe (``SendWindow.probe``), driven by an injected clock: the iteration's last chunk has
no later chunk whose ACK could reveal its loss, so once every chunk was sent the worker asks about it
``reorder`` after the chunk sent just before it was acknowledged, or ``pto`` after its own send when nothing
of the tail came back; repeated probes back off, an ACK of the tail ends them, and only an unprobed last
chunk gives a tail round-trip sample."""

from __future__ import annotations

import numpy as np

from netstorm.lan.sendwindow import SendWindow

CHUNKS, POOL = 10, 4
PTO, REORDER = 0.050, 0.002


def sent_all(at: float = 0.0) -> SendWindow:
    flight = SendWindow(CHUNKS, POOL)
    start, stop = flight.sendable()
    while stop > start:
        flight.sent(start, stop, at)
        flight.ack(np.arange(start, stop - 1 if stop == CHUNKS else stop), at)   # all but the last
        start, stop = flight.sendable()
    return flight


def test_no_probe_until_every_chunk_was_sent() -> None:
    flight = SendWindow(CHUNKS, POOL)
    flight.sent(0, POOL, 0.0)
    assert flight.probe_due(1.0, PTO, REORDER) == float("inf")
    assert flight.probe(1.0, PTO, REORDER) is None


def test_without_any_ack_of_the_tail_the_probe_waits_pto_after_the_last_send() -> None:
    flight = SendWindow(CHUNKS, CHUNKS)
    flight.sent(0, CHUNKS, 1.0)
    assert np.isclose(flight.probe_due(1.0, PTO, REORDER), PTO)
    assert flight.probe(1.0 + PTO * 0.99, PTO, REORDER) is None
    assert flight.probe(1.0 + PTO, PTO, REORDER) == CHUNKS - 1


def test_the_ack_of_the_chunk_before_the_last_makes_it_due_one_reorder_window_later() -> None:
    flight = sent_all(0.0)
    flight.ack(np.array([CHUNKS - 2]), 0.010)    # already acknowledged: no new ACK time
    assert flight.last_ack == 0.0
    assert flight.probe_due(0.0, PTO, REORDER) == REORDER
    assert flight.probe(REORDER / 2, PTO, REORDER) is None
    assert flight.probe(REORDER, PTO, REORDER) == CHUNKS - 1


def test_repeated_probes_back_off_and_an_ack_of_the_tail_ends_them() -> None:
    flight = sent_all(0.0)
    assert flight.probe(REORDER, PTO, REORDER) == CHUNKS - 1
    # no answer: the next one waits pto, then twice that
    assert flight.probe_due(REORDER, PTO, REORDER) == PTO
    assert flight.probe(REORDER + PTO, PTO, REORDER) == CHUNKS - 1
    assert np.isclose(flight.probe_due(REORDER + PTO, PTO, REORDER), 2 * PTO)
    _, tail = flight.ack(np.array([CHUNKS - 1]), 0.5)
    assert flight.probe_due(0.5, PTO, REORDER) == float("inf") and flight.acked.all()
    assert tail is None    # a probed chunk's ACK says nothing about the tail's round trip


def test_an_unprobed_last_chunk_gives_a_tail_sample_from_the_last_send() -> None:
    flight = sent_all(1.0)
    sample, tail = flight.ack(np.array([CHUNKS - 1]), 1.004)
    assert tail is not None and np.isclose(tail, 0.004)
    assert sample is not None and np.isclose(sample, 0.004)
    assert flight.min_rtt == 0.0    # the others were acknowledged as they were sent


def test_a_lost_chunk_below_an_acknowledged_last_one_is_the_gap_rule_s_not_a_tail() -> None:
    flight = SendWindow(CHUNKS, CHUNKS)
    flight.sent(0, CHUNKS, 0.0)
    flight.ack(np.array([c for c in range(CHUNKS) if c != 3]), 0.001)
    assert flight.probe_due(1.0, PTO, REORDER) == float("inf")
    gap, stalled = flight.late(0.001 + 0.01, 0.005, 1.0, reorder=0.005)
    assert gap.tolist() == [3] and not stalled.size
