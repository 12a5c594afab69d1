"""The LAN worker's sender core by plain calls: no sockets, no event loop, a fake clock.

A push sends the pool's window and ends with the exact sum; the stall's RTO resends the oldest chunks and
backs off; a gap is resent (or, with query NACKs, asked about) once its grace and reorder allowance pass;
the tail is probed; the gateway's NACKs are answered; FAILED, MOVED, a disagreeing total and the deadline
end the iteration with a typed outcome; and under any loss and reordering of datagrams in either direction
(hypothesis) the push still ends with the exact sum.
"""

from __future__ import annotations

import heapq
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from netstorm.lan.batch import DatagramBatch
from netstorm.lan.errors import EdgeTimeout, IterationAborted, WireError
from netstorm.lan.header import HEADER_BYTES, Header, Kind
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import ack_packets, control_packet, nack_packets, result_packets
from netstorm.lan.senderactions import Action, Done, Failed, Moved, SendControl, SendData
from netstorm.lan.sendercore import SenderCore
from netstorm.lan.sendwindow import STALL_CHUNKS
from netstorm.lan.tokens import LanTokens
from tests.lan_reference import fixed_point_sums

LAYOUT = EdgeLayout.uniform([300, 45], scale=10, lanes=16, pool=6)
"""22 chunks (19 + 3), at most 6 in flight."""
N = LAYOUT.num_chunks
JOB = 9
WORKER = 1
WORKERS = 3
ITERATION = 5


def contribution(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) * 3).astype(np.float32) for s in LAYOUT.sizes]


MINE = contribution(1)
OTHERS = [contribution(2), contribution(3)]
EXACT = fixed_point_sums([MINE, *OTHERS], LAYOUT.scales)


def core_of(*, query_nacks: bool = False, retransmit: float = 0.005, timeout: float = 30.0) -> SenderCore:
    core = SenderCore(worker=WORKER, job=JOB, tokens=LanTokens(None, JOB), retransmit=retransmit,
                      query_nacks=query_nacks, pull_interval=0.5)
    core.push(ITERATION, MINE, layout=LAYOUT, now=0.0, timeout=timeout)
    return core


def batch_of(items: list[bytes]) -> DatagramBatch:
    batch = DatagramBatch(max(1, len(items)))
    for data in items:
        assert batch.put(data)
    return batch


def datagrams(action: Action) -> list[bytes]:
    if isinstance(action, SendControl):
        return [action.datagram]
    rows = action.rows if action.index is None else action.rows[action.index]
    return [r.tobytes() for r in rows]


def seqs_of(data: bytes) -> list[int]:
    """The chunk a DATA names, or the chunks a QUERY, ACK or NACK lists."""
    head = Header.decode(data)
    if head.kind == Kind.DATA:
        return [LAYOUT.seq(head.tensor, head.chunk)]
    return np.frombuffer(data, "<u4", head.count, HEADER_BYTES).astype(int).tolist()


def kinds(actions: list[Action]) -> list[tuple[Kind, list[int]]]:
    return [(Header.decode(d).kind, seqs_of(d)) for a in actions for d in datagrams(a)]


def results(chunks: list[int] | None = None, total: int = WORKERS) -> list[bytes]:
    out = []
    for t, values in enumerate(EXACT):
        rows = result_packets(LAYOUT, job=JOB, iteration=ITERATION, tensor=t, values=values, total=total)
        out += [r.tobytes() for c, r in enumerate(rows) if chunks is None or LAYOUT.first_slot[t] + c in chunks]
    return out


def acks(seqs: list[int]) -> list[bytes]:
    return ack_packets(np.array(seqs), job=JOB, iteration=ITERATION)


class FakeGateway:
    """The gateway's side as the worker sees it: it ACKs every DATA it gets (again for a copy), answers a
    QUERY with ACKs of what it has and a NACK of the rest, sends every RESULT once this worker's DATA is all
    in (its peers' came already), and answers a PULL with the chunk's RESULT. The sum is of the lanes it
    received, so a wrong or stale resend would show."""

    def __init__(self) -> None:
        self.got: dict[int, np.ndarray] = {}
        self.scales: dict[int, int] = {}
        self.done = False

    def receive(self, data: bytes) -> list[bytes]:
        head = Header.decode(data)
        if head.kind == Kind.DATA:
            seq = LAYOUT.seq(head.tensor, head.chunk)
            self.got[seq] = np.frombuffer(data, "<i4", head.count, HEADER_BYTES).astype(np.int64)
            self.scales[seq] = head.scale
            out = acks([seq])
            if len(self.got) == N and not self.done:
                self.done = True
                out += self.results(list(range(N)))
            return out
        if head.kind == Kind.QUERY:
            listed = seqs_of(data)
            have = [s for s in listed if s in self.got]
            lost = [s for s in listed if s not in self.got]
            return (acks(have) if have else []) + (
                nack_packets(np.array(lost), job=JOB, iteration=ITERATION) if lost else [])
        if head.kind == Kind.PULL and self.done:
            return self.results([LAYOUT.seq(head.tensor, head.chunk)])
        return []

    def results(self, seqs: list[int]) -> list[bytes]:
        out = []
        for seq in seqs:
            tensor, chunk = LAYOUT.locate(seq)
            start, stop = LAYOUT.bounds(tensor, chunk)
            scale = self.scales[seq]
            total = self.got[seq] + sum(np.rint(o[tensor][start:stop].astype(np.float64) * 2.0**scale).astype(np.int64)
                                        for o in OTHERS)
            values = np.zeros(LAYOUT.sizes[tensor], np.float32)
            values[start:stop] = (total.astype(np.float64) * 2.0**-scale).astype(np.float32)
            rows = result_packets(LAYOUT, job=JOB, iteration=ITERATION, tensor=tensor, values=values,
                                  total=WORKERS, chunks=np.array([chunk]))
            out.append(rows[0].tobytes())
        return out


def run(core: SenderCore, gateway: FakeGateway, *, lose: frozenset[int] = frozenset(), seed: int = 0,
        steps: int = 5000) -> tuple[float, list[Action]]:
    """Drive ``core`` against ``gateway`` on a fake clock until its iteration ends: the n-th datagram either
    way is lost when n is in ``lose``, and every delivery to the worker takes its own latency (so datagrams
    overtake each other); the timer fires a microsecond after its time. The time it ended, and every action
    it took."""
    rng = random.Random(seed)
    now, count, order = 0.0, 0, 0
    pending: list[tuple[float, int, bytes]] = []
    taken: list[Action] = []
    for _ in range(steps):
        for action in core.actions():
            taken.append(action)
            if isinstance(action, SendData) and action.first:
                core.sent(now)
            for data in datagrams(action):
                count += 1
                if count - 1 in lose:
                    continue
                for reply in gateway.receive(data):
                    count += 1
                    if count - 1 not in lose:
                        order += 1
                        heapq.heappush(pending, (now + rng.uniform(0.0005, 0.004), order, reply))
        if core.outcome is not None:
            return now, taken
        timer = core.get_timer()
        assert timer is not None and timer >= now - 1e-12
        if pending and pending[0][0] <= timer:
            now = pending[0][0]
            items = []
            while pending and pending[0][0] <= now:
                items.append(heapq.heappop(pending)[2])
            core.datagrams_received(batch_of(items), now)
        else:
            now = timer + 1e-6   # a timer fires a little after its time, never before
            core.handle_timer(now)
    raise AssertionError(f"no outcome after {steps} steps (t={now})")


def assert_exact(core: SenderCore) -> None:
    outcome = core.outcome
    assert isinstance(outcome, Done), outcome
    assert outcome.iteration == ITERATION and outcome.total == WORKERS
    for want, have in zip(EXACT, outcome.result, strict=True):
        np.testing.assert_array_equal(have, want)


def test_a_lossless_push_sends_the_window_and_ends_with_the_exact_sum() -> None:
    core = core_of()
    first = core.actions()
    assert kinds(first) == [(Kind.DATA, [s]) for s in range(LAYOUT.window)]
    assert isinstance(first[0], SendData) and first[0].first
    # each ACK frees one slot: the chunk a pool later goes out
    core.datagrams_received(batch_of(acks([0, 1])), 0.002)
    assert kinds(core.actions()) == [(Kind.DATA, [6]), (Kind.DATA, [7])]
    assert core.timers.rtt == pytest.approx(0.002)
    core2 = core_of()
    _, taken = run(core2, FakeGateway())
    assert_exact(core2)
    assert core2.retransmitted == core2.queries == core2.pulls == 0
    assert sorted(s for k, seqs in kinds(taken) if k == Kind.DATA for s in seqs) == list(range(N))


def test_the_stall_rule_resends_the_oldest_chunks_after_the_rto_and_backs_off() -> None:
    core = core_of()
    core.actions()
    rto = core.timers.rto()
    assert rto == pytest.approx(4 * 0.005) and core.get_timer() == pytest.approx(rto)
    core.handle_timer(rto * 0.999)
    assert core.actions() == []
    core.handle_timer(rto * 1.001)
    got = kinds(core.actions())
    # the oldest few resent (not first sends, so no loss injection), then asked about
    assert got == [*((Kind.DATA, [s]) for s in range(min(STALL_CHUNKS, LAYOUT.window))),
                   (Kind.QUERY, list(range(min(STALL_CHUNKS, LAYOUT.window))))]
    assert core.stall_resends == core.retransmitted == LAYOUT.window
    # no ACK still: the next round waits twice as long
    core.handle_timer(rto * 1.001 + rto * 1.5)
    assert core.actions() == []
    core.handle_timer(rto * 1.001 + rto * 2.01)
    assert core.stall_resends == 2 * LAYOUT.window


def test_a_windows_clocks_start_when_the_shells_send_returns() -> None:
    """A window's send can take a while: its chunks' timeouts, and the stall's, start once they have left."""
    core = core_of()
    core.actions()
    core.sent(0.01)
    assert core.window is not None and (core.window.sent_at[: LAYOUT.window] == 0.01).all()
    rto = core.timers.rto()
    assert core.get_timer() == pytest.approx(0.01 + rto)
    core.handle_timer(0.01 + rto * 0.999)
    assert core.actions() == [] and core.stall_resends == 0
    core.handle_timer(0.01 + rto * 1.001)
    assert core.stall_resends == LAYOUT.window


@pytest.mark.parametrize("query_nacks", [False, True], ids=["resend", "query"])
def test_a_gap_below_an_acknowledged_chunk_is_taken_after_its_grace(query_nacks: bool) -> None:
    core = core_of(query_nacks=query_nacks)
    core.actions()
    core.datagrams_received(batch_of(acks([0, 1, 3, 4, 5])), 0.001)   # chunk 2's ACK never comes
    assert kinds(core.actions()) == [(Kind.DATA, [6]), (Kind.DATA, [7])]   # chunk 8 waits for 2's slot
    grace = core.timers.grace()
    assert grace == pytest.approx(0.005)   # the floor: 1.25 x the 1 ms round trip is shorter
    assert core.get_timer() == pytest.approx(0.001 + grace if query_nacks else grace)
    core.handle_timer(grace * 0.99)
    assert core.actions() == []
    core.handle_timer(0.001 + grace * 1.01)
    got = kinds(core.actions())
    if query_nacks:   # asked about only: the gateway NACKs whoever is missing from it
        assert got == [(Kind.QUERY, [2])] and core.retransmitted == 0
    else:
        assert got == [(Kind.DATA, [2]), (Kind.QUERY, [2])] and core.retransmitted == 1


@pytest.mark.parametrize("query_nacks", [False, True], ids=["resend", "query"])
def test_the_tail_is_probed_reorder_after_the_chunk_before_it_completes(query_nacks: bool) -> None:
    core = core_of(query_nacks=query_nacks)
    now = 0.0
    while core.window is not None and core.window.next < N:   # each window acknowledged a round trip later
        core.actions()
        now += 0.001
        core.datagrams_received(batch_of(acks(list(range(core.window.next)))), now)
    core.actions()
    now += 0.001
    core.datagrams_received(batch_of(acks(list(range(N - 1)))), now)   # all but the last chunk
    assert core.actions() == [] and core.window is not None
    reorder = core.timers.reorder(core.window)
    assert reorder == pytest.approx(0.001)   # the shortest round trip seen
    core.handle_timer(now + reorder * 0.99)
    assert core.actions() == [] and core.tail_probes == 0
    core.handle_timer(now + reorder * 1.01)
    want = [(Kind.QUERY, [N - 1])] if query_nacks else [(Kind.DATA, [N - 1]), (Kind.QUERY, [N - 1])]
    assert kinds(core.actions()) == want and core.tail_probes == 1


def test_nacks_resend_what_the_gateway_lists_while_sending_and_while_gathering() -> None:
    core = core_of()
    core.actions()
    core.datagrams_received(batch_of(nack_packets(np.array([1, 4, 9]), job=JOB, iteration=ITERATION)), 0.001)
    sent = core.actions()
    assert kinds(sent) == [(Kind.DATA, [1]), (Kind.DATA, [4])]   # 9 was never sent
    assert isinstance(sent[0], SendData) and sent[0].index is None and not sent[0].first
    assert core.nacks.resent == 2
    # every chunk acknowledged: a NACK now (a cluster that lost a chunk's sum) is answered whatever was acked
    core.datagrams_received(batch_of(acks(list(range(N)))), 0.002)
    core.actions()
    assert core.window is None and core.outcome is None
    core.datagrams_received(batch_of(nack_packets(np.array([9]), job=JOB, iteration=ITERATION)), 0.003)
    assert kinds(core.actions()) == [(Kind.DATA, [9])]
    core.datagrams_received(batch_of(results()), 0.004)
    assert_exact(core)


def test_no_result_pulls_one_chunk_then_gives_up_at_the_deadline_with_a_typed_error() -> None:
    core = core_of(timeout=2.0)
    core.actions()
    core.datagrams_received(batch_of(acks(list(range(N)))), 0.001)
    while core.window is not None:
        core.actions()
        core.datagrams_received(batch_of(acks(list(range(N)))), 0.001)
    core.actions()
    assert core.get_timer() == pytest.approx(0.001 + 0.5)   # the pull interval
    core.handle_timer(0.501)
    assert kinds(core.actions()) == [(Kind.PULL, [])] and core.pulls == 1   # one while none arrived
    core.datagrams_received(batch_of(results(list(range(5)))), 0.6)
    quiet = 4 * core.timers.rto()   # once results flow, silence of four RTOs means some were lost
    assert quiet == pytest.approx(0.08)
    core.handle_timer(0.6 + quiet * 0.99)
    assert core.actions() == []
    core.handle_timer(0.6 + quiet * 1.01)
    assert [Header.decode(d).kind for a in core.actions() for d in datagrams(a)] == [Kind.PULL] * (N - 5)
    core.handle_timer(2.0)
    assert isinstance(core.outcome, Failed) and isinstance(core.outcome.error, EdgeTimeout)
    assert f"{N - 5} result chunks" in str(core.outcome.error)
    assert core.get_timer() is None


def test_unacknowledged_chunks_at_the_deadline_fail_the_push_with_a_typed_error() -> None:
    core = core_of(timeout=0.1)
    _, _ = run(core, FakeGateway(), lose=frozenset(range(10**6)))   # nothing ever arrives
    assert isinstance(core.outcome, Failed) and isinstance(core.outcome.error, EdgeTimeout)
    assert f"{N} chunks never acknowledged" in str(core.outcome.error)


def test_failed_moved_and_a_disagreeing_total_end_the_iteration() -> None:
    core = core_of()
    core.datagrams_received(batch_of([control_packet(Kind.FAILED, job=JOB, worker=0, iteration=ITERATION)]), 0.001)
    assert isinstance(core.outcome, Failed) and isinstance(core.outcome.error, IterationAborted)
    core = core_of()
    moved = nack_packets(np.array([1]), job=JOB, iteration=ITERATION, epoch=3)
    core.datagrams_received(batch_of(moved), 0.001)
    assert core.outcome == Moved(3) and core.announced == 3 and core.moved == 1 and core.nacks.resent == 0
    core = core_of()
    core.datagrams_received(batch_of(results([0]) + results([1], total=WORKERS + 1)), 0.001)
    assert isinstance(core.outcome, Failed) and isinstance(core.outcome.error, WireError)
    # another iteration's FAILED, or another job's, changes nothing
    core = core_of()
    core.datagrams_received(batch_of([control_packet(Kind.FAILED, job=JOB, worker=0, iteration=ITERATION + 1),
                                      control_packet(Kind.FAILED, job=JOB + 1, worker=0, iteration=ITERATION)]), 0.001)
    assert core.outcome is None


def test_forged_answers_are_counted_and_change_nothing() -> None:
    secret = b"k" * 32
    core = SenderCore(worker=WORKER, job=JOB, tokens=LanTokens(secret, JOB))
    core.push(ITERATION, MINE, layout=LAYOUT, now=0.0, timeout=30.0)
    core.actions()
    tokens = LanTokens(secret, JOB)
    forged = ack_packets(np.array([0, 1]), job=JOB, iteration=ITERATION, token=tokens.gateway(WORKER, ITERATION) ^ 1)
    failed = control_packet(Kind.FAILED, job=JOB, worker=0, iteration=ITERATION, token=7)
    core.datagrams_received(batch_of([*forged, failed]), 0.001)
    assert core.forged == 2 and core.outcome is None and core.actions() == []
    assert core.window is not None and not core.window.acked.any()
    genuine = ack_packets(np.array([0, 1]), job=JOB, iteration=ITERATION, token=tokens.gateway(WORKER, ITERATION))
    core.datagrams_received(batch_of(genuine), 0.002)
    assert core.window.acked[:2].all() and kinds(core.actions()) == [(Kind.DATA, [6]), (Kind.DATA, [7])]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lose=st.frozensets(st.integers(0, 160), max_size=40), seed=st.integers(0, 2**16),
       query_nacks=st.booleans())
def test_any_loss_and_reordering_still_ends_with_the_exact_sum(lose: frozenset[int], seed: int,
                                                              query_nacks: bool) -> None:
    """Whatever datagrams are lost either way (DATA, ACKs, QUERYs, NACKs, RESULTs, PULLs) and however the
    rest overtake each other, the push ends in time with the exact sum, and resends only chunks it sent."""
    core = core_of(query_nacks=query_nacks)
    end, taken = run(core, FakeGateway(), lose=lose, seed=seed)
    assert_exact(core)
    assert end < 30.0
    assert all(0 <= s < N for k, seqs in kinds(taken) if k in (Kind.DATA, Kind.QUERY) for s in seqs)
