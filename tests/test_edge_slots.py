"""Slot semantics, identical on both aggregators: the XDP program (run with BPF_PROG_TEST_RUN, no
interface needed) and the userspace fallback. Sums are checked exactly against numpy int64 sums."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from bpf.fallback import UserspaceAggregator
from netstorm.lan.fixedpoint import rescale_for
from netstorm.lan.header import Flag, Header, Kind, lanes_of
from netstorm.lan.packets import data_packets
from netstorm.lan.slots import SlotEvent
from tests.edge_programs import JOB, LAYOUT, PORT, SLOT_TENSORS, shared_program

SLOT_CHUNKS = sum(LAYOUT.chunks[t] for t in SLOT_TENSORS)
_iterations = itertools.count(1)


class Backend:
    def __init__(self, kind: str, agg: Any) -> None:
        self.kind = kind
        self.agg = agg

    def configure(self, expected: int, timeout: float = 5.0, max_nacks: int = 3) -> None:
        if isinstance(self.agg, UserspaceAggregator):
            self.agg.expected, self.agg.timeout, self.agg.max_nacks = expected, timeout, max_nacks
        else:
            self.agg.configure(job=JOB, port=PORT, expected=expected, timeout=timeout, max_nacks=max_nacks)

    def feed(self, datagram: bytes) -> bytes | None:
        if isinstance(self.agg, UserspaceAggregator):
            return self.agg.on_data(datagram, time.monotonic())
        from bpf.xdp import XDP_PASS, udp_frame

        verdict, frame = self.agg.test_run(udp_frame(datagram, dport=PORT))
        return frame[42:] if verdict == XDP_PASS else None

    def events(self, wait: float) -> list[SlotEvent]:
        deadline = time.monotonic() + wait
        while True:
            if isinstance(self.agg, UserspaceAggregator):
                found = self.agg.expire(time.monotonic())
            else:
                found = self.agg.poll_events(50)
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.01)


@pytest.fixture(scope="module")
def xdp_aggregator() -> Iterator[Any]:
    yield shared_program()


@pytest.fixture(params=["userspace", pytest.param("xdp", marks=[pytest.mark.root, pytest.mark.bcc, pytest.mark.slow])])
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "xdp":
        return Backend("xdp", request.getfixturevalue("xdp_aggregator"))
    return Backend("userspace", UserspaceAggregator(LAYOUT, job=JOB, expected=1, timeout=5.0))


def contributions(rng: np.random.Generator, workers: int) -> list[list[np.ndarray]]:
    return [[rng.standard_normal(LAYOUT.sizes[t]).astype(np.float32) for t in SLOT_TENSORS] for _ in range(workers)]


def quantised_sum(values: list[list[np.ndarray]], tensor: int, scale: int) -> np.ndarray:
    return np.sum([np.rint(v[tensor].astype(np.float64) * 2.0**scale).astype(np.int64) for v in values], axis=0)


def test_exact_sums_over_iterations_in_any_order_with_duplicates(backend: Backend) -> None:
    rng = np.random.default_rng(7)
    workers = 5
    backend.configure(expected=(1 << workers) - 1)
    for _ in range(4):
        iteration = next(_iterations)
        values = contributions(rng, workers)
        datagrams = [bytes(row) for w in range(workers) for t in SLOT_TENSORS
                     for row in data_packets(LAYOUT, job=JOB, worker=w, iteration=iteration, tensor=t,
                                             values=values[w][t])]
        order = rng.permutation(len(datagrams))
        dups = rng.choice(len(datagrams), size=len(datagrams) // 3)
        got: dict[tuple[int, int], np.ndarray] = {}
        for i in [*order[: len(order) // 2], *dups, *order[len(order) // 2:]]:
            out = backend.feed(datagrams[i])
            if out is None:
                continue
            head = Header.decode(out)
            assert head.kind == Kind.AGG and head.flags == Flag.NONE and head.iteration == iteration
            key = (head.tensor, head.chunk)
            # a duplicate arriving after completion re-emits the same aggregate; nothing else passes
            if key in got:
                assert np.array_equal(got[key], lanes_of(out)[: head.count])
            got[key] = lanes_of(out)[: head.count].copy()
        assert len(got) == SLOT_CHUNKS
        for t in SLOT_TENSORS:
            exact = quantised_sum(values, t, LAYOUT.scales[t])
            mine = np.concatenate([got[(t, c)] for c in range(LAYOUT.chunks[t])])
            assert np.array_equal(mine.astype(np.int64), exact)


def test_duplicate_before_completion_is_dropped_and_not_added(backend: Backend) -> None:
    backend.configure(expected=0b11)
    iteration = next(_iterations)
    one = np.ones(7, np.float32)
    a = bytes(data_packets(LAYOUT, job=JOB, worker=0, iteration=iteration, tensor=2, values=one)[0])
    b = bytes(data_packets(LAYOUT, job=JOB, worker=1, iteration=iteration, tensor=2, values=2 * one)[0])
    assert backend.feed(a) is None
    assert backend.feed(a) is None
    out = backend.feed(b)
    assert out is not None
    assert np.array_equal(lanes_of(out)[:7], np.full(7, 3 * 2**12))


def test_lane_overflow_is_flagged_never_wrapped_and_rescale_fits(backend: Backend) -> None:
    backend.configure(expected=0b11)
    iteration = next(_iterations)
    big = np.full(7, 2.0**30 / 2**12 * 1.5, np.float32)   # each fits int32 at scale 12, the sum does not
    rows = [bytes(data_packets(LAYOUT, job=JOB, worker=w, iteration=iteration, tensor=2, values=big)[0])
            for w in range(2)]
    assert Header.decode(rows[0]).flags == Flag.NONE
    backend.feed(rows[0])
    out = backend.feed(rows[1])
    assert out is not None
    head = Header.decode(out)
    assert head.flags & Flag.OVERFLOW
    # second round at the scale the agent derives from the slot's need: exact, no overflow
    new = rescale_for(head.need, 2)
    assert new < 12
    rows = [bytes(data_packets(LAYOUT, job=JOB, worker=w, iteration=iteration, tensor=2, values=big, scale=new)[0])
            for w in range(2)]
    backend.feed(rows[0])
    out = backend.feed(rows[1])
    assert out is not None and Header.decode(out).flags == Flag.NONE
    expected = 2 * np.rint(big.astype(np.float64) * 2.0**new)
    assert np.array_equal(lanes_of(out)[:7].astype(np.int64), expected.astype(np.int64))


def test_own_value_out_of_range_is_flagged_by_the_sender(backend: Backend) -> None:
    backend.configure(expected=0b11)
    iteration = next(_iterations)
    huge = np.full(7, 1e9, np.float32)
    rows = [bytes(data_packets(LAYOUT, job=JOB, worker=w, iteration=iteration, tensor=2, values=huge)[0])
            for w in range(2)]
    assert Header.decode(rows[0]).flags & Flag.OVERFLOW
    backend.feed(rows[0])
    out = backend.feed(rows[1])
    assert out is not None and Header.decode(out).flags & Flag.OVERFLOW
    assert np.rint(1e9 * 2.0 ** Header.decode(out).need) <= 2**31 - 1


def test_stale_iteration_is_dropped_and_newer_takes_over(backend: Backend) -> None:
    backend.configure(expected=0b11)
    old, new = next(_iterations), next(_iterations)
    row = data_packets(LAYOUT, job=JOB, worker=0, iteration=new, tensor=2, values=np.ones(7))[0]
    assert backend.feed(bytes(row)) is None
    stale = data_packets(LAYOUT, job=JOB, worker=1, iteration=old, tensor=2, values=np.ones(7))[0]
    assert backend.feed(bytes(stale)) is None
    out = backend.feed(bytes(data_packets(LAYOUT, job=JOB, worker=1, iteration=new, tensor=2,
                                          values=np.ones(7))[0]))
    assert out is not None and np.array_equal(lanes_of(out)[:7], np.full(7, 2 * 2**12))


def test_data_past_the_horizon_is_refused_counted_and_leaves_the_open_slot_exact(backend: Backend) -> None:
    backend.configure(expected=0b11)
    iteration = next(_iterations)
    for _ in range(3):
        next(_iterations)
    counted = backend.agg.stats() if backend.kind == "xdp" else backend.agg.counters
    before = counted["future"]
    backend.agg.bound(iteration)
    try:
        part = data_packets(LAYOUT, job=JOB, worker=0, iteration=iteration, tensor=2, values=np.ones(7))[0]
        assert backend.feed(bytes(part)) is None
        for ahead in (2, 1, 2**31 - 1):   # k+2, k+1 and the farthest an iteration can be ahead, modulo 2**32
            far = data_packets(LAYOUT, job=JOB, worker=1, iteration=(iteration + ahead) & 0xFFFFFFFF, tensor=2,
                               values=np.full(7, 1000.0))[0]
            assert backend.feed(bytes(far)) is None
        counted = backend.agg.stats() if backend.kind == "xdp" else backend.agg.counters
        assert counted["future"] - before == 3
        out = backend.feed(bytes(data_packets(LAYOUT, job=JOB, worker=1, iteration=iteration, tensor=2,
                                              values=2 * np.ones(7))[0]))
        assert out is not None and Header.decode(out).iteration == iteration
        assert np.array_equal(lanes_of(out)[:7], np.full(7, 3 * 2**12))
        backend.agg.bound(iteration + 1)   # the next iteration is summed once the bound moves
        nxt = data_packets(LAYOUT, job=JOB, worker=0, iteration=iteration + 1, tensor=2, values=np.ones(7))[0]
        assert backend.feed(bytes(nxt)) is None
        counted = backend.agg.stats() if backend.kind == "xdp" else backend.agg.counters
        assert counted["future"] - before == 3
    finally:
        backend.agg.bound(None)


def test_timer_reports_the_slot_and_its_bitmap_until_complete(backend: Backend) -> None:
    backend.configure(expected=0b1011, timeout=0.05, max_nacks=2)
    iteration = next(_iterations)
    for w in (0, 3):
        backend.feed(bytes(data_packets(LAYOUT, job=JOB, worker=w, iteration=iteration, tensor=1,
                                        values=np.ones(358))[0]))
    events = backend.events(wait=3.0)
    assert events, "the slot timer never reported"
    ev = events[0]
    assert (ev.iteration, ev.tensor, ev.chunk, ev.slot) == (iteration, 1, 0, LAYOUT.slot(1, 0))
    assert ev.bitmap == 0b1001 and ev.missing == [1]
    # complete it: no further report after the period
    backend.feed(bytes(data_packets(LAYOUT, job=JOB, worker=1, iteration=iteration, tensor=1,
                                    values=np.ones(358))[0]))
    backend.events(wait=0.2)
    assert backend.events(wait=0.3) == []


@pytest.mark.root
@pytest.mark.bcc
@pytest.mark.slow
def test_concurrent_runs_on_two_cpus_serialise_per_slot(xdp_aggregator: Any) -> None:
    """Two threads run the program at once (the syscall drops the GIL, the kernel runs them on both CPUs),
    hitting the same slots: the per-slot bpf_spin_lock must keep every sum exact."""
    from bpf.xdp import XDP_PASS, udp_frame

    backend = Backend("xdp", xdp_aggregator)
    workers = 4
    backend.configure(expected=(1 << workers) - 1)
    rng = np.random.default_rng(3)
    rounds = 6
    values = [contributions(rng, workers) for _ in range(rounds)]
    base = next(_iterations)
    for _ in range(rounds):
        next(_iterations)
    outputs: list[bytes] = []
    lock = threading.Lock()

    def run(ws: list[int], r: int) -> None:
        frames = [udp_frame(bytes(row), dport=PORT) for w in ws for t in range(3)
                  for row in data_packets(LAYOUT, job=JOB, worker=w, iteration=base + r, tensor=t,
                                          values=values[r][w][t])]
        for frame in frames:
            verdict, out = xdp_aggregator.test_run(frame)
            if verdict == XDP_PASS:
                with lock:
                    outputs.append(out[42:])

    for r in range(rounds):
        threads = [threading.Thread(target=run, args=([0, 2], r)), threading.Thread(target=run, args=([1, 3], r))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    got = {}
    for out in outputs:
        head = Header.decode(out)
        got[(head.iteration, head.tensor, head.chunk)] = lanes_of(out)[: head.count].astype(np.int64)
    assert len(got) == rounds * SLOT_CHUNKS
    for r in range(rounds):
        for t in range(3):
            mine = np.concatenate([got[(base + r, t, c)] for c in range(LAYOUT.chunks[t])])
            assert np.array_equal(mine, quantised_sum(values[r], t, 12))
    assert len(outputs) == rounds * SLOT_CHUNKS


def test_data_needs_the_installed_token_and_the_aggregate_carries_the_agents(backend: Backend) -> None:
    """With tokens required, DATA is aggregated only with the token installed for its worker and iteration;
    a wrong token, a token of another iteration sharing the window entry, or one never installed is
    dropped and counted, and the aggregate carries the value only the agent knows."""
    from netstorm.lan.slots import TOKEN_WINDOW

    backend.configure(expected=0b11)
    iteration = next(_iterations)
    later = iteration + TOKEN_WINDOW          # same window entry, not installed
    for _ in range(TOKEN_WINDOW + 1):
        next(_iterations)
    agg_token = 0xA66A66A66
    backend.agg.require_tokens(agg_token)
    try:
        backend.agg.install_tokens([(0, iteration, 101), (1, iteration, 202)])
        before = counters(backend)["bad_token"]

        def row(worker: int, k: int, token: int, value: float) -> bytes:
            return bytes(data_packets(LAYOUT, job=JOB, worker=worker, iteration=k, tensor=2,
                                      values=np.full(7, value), token=token)[0])

        assert backend.feed(row(1, iteration, 101, 50.0)) is None     # worker 0's token, worker 1's id
        assert backend.feed(row(1, later, 202, 50.0)) is None         # another iteration in the same entry
        assert backend.feed(row(0, iteration + 1, 0, 50.0)) is None   # nothing installed there
        assert counters(backend)["bad_token"] - before == 3
        assert backend.feed(row(0, iteration, 101, 1.0)) is None
        out = backend.feed(row(1, iteration, 202, 2.0))
        assert out is not None
        head = Header.decode(out)
        assert head.kind == Kind.AGG and head.token == agg_token
        assert np.array_equal(lanes_of(out)[:7], np.full(7, 3 * 2**12))
    finally:
        backend.agg.require_tokens(0)


def counters(backend: Backend) -> dict[str, int]:
    """The aggregator's counters: the XDP program's map (summed over CPUs) or the fallback's."""
    if isinstance(backend.agg, UserspaceAggregator):
        return dict(backend.agg.counters)
    return dict(backend.agg.stats())


def test_slot_reads_give_each_slot_its_bitmap_alone_in_runs_or_in_any_order(backend: Backend) -> None:
    """What a NACK is built from: lone slots (one plain lookup each in XDP), runs of consecutive ones (one
    batched lookup), repeats and any order give each slot's own key and contributor bitmap."""
    workers = 4
    backend.configure(expected=(1 << workers) - 1)
    iteration = next(_iterations)
    tensor = SLOT_TENSORS[0]
    rng = np.random.default_rng(12)
    values = rng.standard_normal(LAYOUT.sizes[tensor]).astype(np.float32)
    chunks = min(LAYOUT.chunks[tensor], 12)
    want = {}
    for chunk in range(chunks):
        senders = [w for w in range(workers) if rng.random() < 0.5] or [0]
        if len(senders) == workers:
            senders = senders[1:]       # a slot that completes is released; keep every one open
        for w in senders:
            backend.feed(data_packets(LAYOUT, job=JOB, worker=w, iteration=iteration, tensor=tensor, values=values,
                                      chunks=np.array([chunk]))[0].tobytes())
        want[LAYOUT.slot(tensor, chunk)] = (chunk, sum(1 << w for w in senders))
    slots = np.array(list(want))
    order = np.concatenate([slots[::-1], slots[[0, slots.size - 1, slots.size // 2]], slots[:1]])
    for index in ([int(slots[slots.size // 2])], slots, order, slots[::2]):
        states = backend.agg.slot_states(np.asarray(index))
        assert [(int(s["iteration"]), int(s["tensor"]), int(s["chunk"]), int(s["bitmap"])) for s in states] == \
            [(iteration, tensor, *want[int(i)]) for i in index]
