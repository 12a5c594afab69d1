"""The gateway's outbox (netstorm/lan/outbox.py): one writer's order of sends, with an injected clock. Result bursts
to several destinations interleave batch by batch, control datagrams and bulk take turns, a paced
destination's bytes never exceed its rate, a refused send changes nothing, and memory stays bounded."""

from __future__ import annotations

import numpy as np
import pytest

from netstorm.lan.outbox import Outbox

A, B, C = ("10.0.0.1", 1), ("10.0.0.2", 1), ("10.0.0.3", 1)


def rows(n: int, size: int = 100, first: int = 0) -> np.ndarray:
    """``n`` datagrams whose first byte numbers them (from ``first``)."""
    out = np.zeros((n, size), np.uint8)
    out[:, 0] = np.arange(first, first + n) % 256
    return out


def drain(box: Outbox, now: float = 0.0, limit: int = 10_000) -> list[tuple[tuple[str, int], int, bool]]:
    """Everything the outbox lets go at ``now``: (address, datagrams, bulk) per send."""
    sent: list[tuple[tuple[str, int], int, bool]] = []
    while (batch := box.next(now)) is not None and len(sent) < limit:
        sent.append((batch.address, batch.count, batch.bulk))
        box.done(batch, now)
    return sent


def test_bursts_to_several_destinations_leave_in_turns_of_one_batch() -> None:
    box = Outbox(batch=4)
    box.bulk(rows(10), A)
    box.bulk(rows(3), B)
    box.bulk(rows(5), C)
    order = drain(box)
    assert order == [(A, 4, True), (B, 3, True), (C, 4, True), (A, 4, True), (C, 1, True), (A, 2, True)]
    assert box.pending == 0 and box.sent_datagrams == 18


def test_a_batch_never_holds_more_bytes_than_one_segmented_send() -> None:
    box = Outbox(batch=64, batch_bytes=1000)
    box.bulk(rows(20, size=300), A)
    assert [count for _, count, _ in drain(box)] == [3] * 6 + [2]


def test_the_datagrams_go_out_in_order_and_whole() -> None:
    box = Outbox(batch=7)
    box.bulk(rows(30), A)
    seen: list[int] = []
    while (batch := box.next(0.0)) is not None:
        data = np.frombuffer(batch.data, np.uint8).reshape(batch.count, batch.size)
        seen.extend(int(x) for x in data[:, 0])
        box.done(batch, 0.0)
    assert seen == list(range(30))


def test_control_and_bulk_take_turns_so_neither_starves_the_other() -> None:
    box = Outbox(batch=8, control_per_turn=3)
    for i in range(7):
        assert box.control(bytes([i]) * 10, B)
    box.bulk(rows(16), A)
    kinds = ["bulk" if bulk else "control" for _, _, bulk in drain(box)]
    assert kinds == ["control"] * 3 + ["bulk"] + ["control"] * 3 + ["bulk"] + ["control"]


def test_a_refused_send_is_asked_for_again_unchanged() -> None:
    box = Outbox(batch=4)
    box.bulk(rows(6), A)
    first = box.next(0.0)
    again = box.next(0.0)   # the send failed (a full buffer): nothing was consumed
    assert first is not None and again is not None
    assert bytes(first.data) == bytes(again.data) and box.pending == 6
    box.done(again, 0.0)
    assert box.pending == 2


def test_a_paced_destination_gets_no_more_than_its_rate_and_the_others_are_not_held() -> None:
    box = Outbox(batch=10)
    box.pace(A, 10_000.0)        # 10 kB/s: one 1000-byte batch per 0.1 s
    box.bulk(rows(50), A)
    box.bulk(rows(50), B)
    now, sent_a = 0.0, 0
    while box.pending:
        batch = box.next(now)
        if batch is None:
            wake = box.wake_at(now)
            assert wake is not None and wake > now
            now = wake
            continue
        if batch.address == A:
            sent_a += batch.count * batch.size
            # credit of at most one batch: bytes sent by ``now`` stay within rate * now + one batch
            assert sent_a <= 10_000.0 * now + 1000 + 1e-6
        else:
            assert now == 0.0     # B is unpaced: all of it leaves at once, between A's batches
        box.done(batch, now)
    assert sent_a == 5000 and now == pytest.approx(0.4)


def test_memory_is_bounded_per_destination_and_stale_bursts_are_forgotten() -> None:
    box = Outbox(keep=8, control_limit=3)
    for k in range(5):
        box.bulk(rows(4), A, tag=k)
    assert box.pending_to(A) == 8 and box.dropped_bursts == 3
    for _ in range(8):   # single datagrams (PULL answers) count as what they hold
        box.bulk(rows(1), C, tag=4)
    assert box.pending_to(C) == 8 and box.dropped_bursts == 3
    box.bulk(rows(4), B, tag=1)
    box.forget(4)
    assert box.pending_to(A) == 4 and box.pending_to(B) == 0 and box.pending_to(C) == 8 and box.dropped_bursts == 5
    assert [box.control(b"x", A) for _ in range(4)] == [True, True, True, False]
    assert box.refused_control == 1


def test_nothing_queued_means_nothing_to_wake_for() -> None:
    box = Outbox()
    assert box.next(0.0) is None and box.wake_at(0.0) is None
    with pytest.raises(ValueError):
        box.pace(A, 0.0)
    with pytest.raises(ValueError):
        box.bulk(np.zeros(10, np.uint8), A)
