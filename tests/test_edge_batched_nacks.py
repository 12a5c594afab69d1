"""NACKs listing many chunks (wire version 5): the agent sends one NACK datagram per worker and wake-up,
listing every chunk that worker is missing from, and the worker resends exactly the listed chunks it still
owes, all in one segmented send. Checked without a network (the worker's batch handling and the agent's
slot read, with hostile and fuzzed lists: numbers past the layout, duplicates, chunks acknowledged or resent
moments ago) and in network namespaces on both aggregation paths (several losses of one worker answered
with exactly those resends, and exact sums under 1 % loss)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import pytest

from bpf.agent import EdgeAgent
from netstorm.lan.batch import DatagramBatch
from netstorm.lan.gatewaycore import GatewayCore
from netstorm.lan.header import HEADER_BYTES, HEADER_DTYPE, OFFSETS, TOKEN_AT, Header, Kind
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import ack_packets, data_packets, nack_packets
from netstorm.lan.sender import EdgeSender
from netstorm.lan.senderactions import SendData
from netstorm.lan.sendercore import SenderCore
from netstorm.lan.tokens import LanTokens
from tests.edge_programs import NACK_LAYOUT, nack_iterations, nack_program
from tests.lan_gateway import KernelMaps, hello, sent
from tests.lan_reference import fixed_point_sums

LAYOUT = EdgeLayout.uniform([3000, 7], scale=10, lanes=64)
"""48 chunks of 64 lanes."""
JOB = 21
SECRET = b"n" * 32


def batch_of(items: list[bytes]) -> DatagramBatch:
    batch = DatagramBatch(max(1, len(items)))
    for row, data in enumerate(items):
        batch.buf[row, : len(data)] = np.frombuffer(data, np.uint8)
        batch.lengths[row] = len(data)
    batch.count = len(items)
    return batch


def stamped(datagram: bytes, token: int) -> bytes:
    return datagram[:TOKEN_AT] + token.to_bytes(8, "little") + datagram[TOKEN_AT + 8:]


def chunks_of(rows: np.ndarray) -> list[int]:
    """Sequence numbers of DATA rows."""
    heads = np.frombuffer(np.ascontiguousarray(rows[:, :HEADER_BYTES]).tobytes(), HEADER_DTYPE)
    return [LAYOUT.seq(int(t), int(c)) for t, c in zip(heads["tensor"], heads["chunk"], strict=True)]


def pushing(iteration: int, pool: int = 40) -> SenderCore:
    """A worker's core sending ``iteration`` at time 0 with a pool of ``pool`` chunks (so chunks ``pool``.. are
    not sent yet); "resent moments ago" covers the whole test."""
    core = SenderCore(worker=2, job=JOB, tokens=LanTokens(SECRET, JOB), retransmit=60.0)
    values = [np.arange(s, dtype=np.float32) / 7 for s in LAYOUT.sizes]
    layout = EdgeLayout.uniform(LAYOUT.sizes, scale=10, lanes=LAYOUT.lanes, pool=pool)
    core.push(iteration, values, layout=layout, now=0.0, timeout=60.0)
    core.actions()
    return core


def acks(iteration: int, seqs: np.ndarray) -> list[bytes]:
    token = LanTokens(SECRET, JOB).gateway(2, iteration)
    return [stamped(a, token) for a in ack_packets(seqs, job=JOB, iteration=iteration)] if seqs.size else []


def resends(core: SenderCore) -> list[np.ndarray]:
    """The rows of the NACK resends the core asked for since the last look."""
    out = []
    for action in core.actions():
        assert isinstance(action, SendData) and action.index is None and not action.first
        out.append(action.rows)
    return out


def test_a_listed_nack_queues_exactly_its_chunks_once_and_they_leave_in_one_send() -> None:
    tokens = LanTokens(SECRET, JOB)
    iteration = 6
    core = pushing(iteration)                    # chunks 40.. were never sent: nothing to resend
    core.datagrams_received(batch_of(acks(iteration, np.array([9]))), 0.0)   # chunk 9 completed: stale
    assert core.actions() == []
    mine = tokens.gateway(2, iteration)
    listed = [1, 3, 3, 9, 42, LAYOUT.num_chunks, 2**32 - 1, 4]
    genuine = stamped(nack_packets(np.array(listed), job=JOB, iteration=iteration)[0], mine)
    split = [stamped(d, mine) for d in nack_packets(np.array([4, 7, 1]), job=JOB, iteration=iteration, per_packet=2)]
    forged = nack_packets(np.array([11, 12]), job=JOB, iteration=iteration, token=mine ^ 1)[0]
    other_iteration = stamped(nack_packets(np.array([13]), job=JOB, iteration=iteration + 1)[0],
                              tokens.gateway(2, iteration + 1))
    overrun = genuine[:-8]                          # count says more lanes than the payload holds
    core.datagrams_received(batch_of([genuine, *split, forged, other_iteration, overrun]), 0.0)
    sent = resends(core)   # one set of rows: one segmented send for all four
    assert [chunks_of(rows) for rows in sent] == [[1, 3, 4, 7]]
    assert core.forged == 1 and core.nacks.resent == core.retransmitted == 4
    np.testing.assert_array_equal(sent[0], core.rows[[1, 3, 4, 7]])
    # the same NACK again within the round trip (another worker's QUERY brings it) resends nothing
    core.datagrams_received(batch_of([genuine]), 0.0)
    assert core.nacks.resent == 4 and resends(core) == []


def test_fuzzed_nack_lists_resend_only_what_is_owed() -> None:
    """Random lists (numbers anywhere in u32, duplicates, empty) against the rule stated directly: a chunk is
    resent iff it is listed, in the layout, sent, not acknowledged and not resent within the round trip."""
    tokens = LanTokens(SECRET, JOB)
    rng = np.random.default_rng(18)
    iteration = 3
    n = LAYOUT.num_chunks
    for _ in range(60):
        core = pushing(iteration, pool=int(rng.integers(1, n + 1)))
        acked = np.flatnonzero(rng.random(n) < 0.3)
        core.datagrams_received(batch_of(acks(iteration, acked)), 0.0)   # may open the window further
        recent = np.flatnonzero(rng.random(n) < 0.2)
        core.datagrams_received(batch_of([stamped(d, tokens.gateway(2, iteration))
                                          for d in nack_packets(recent, job=JOB, iteration=iteration)]), 0.0)
        core.actions()
        window = core.window
        assert window is not None
        sent, done = window.next, window.acked.copy()
        before = core.nacks.resent
        resent = set(recent[(recent < sent) & ~done[np.minimum(recent, n - 1)]].tolist())
        assert before == len(resent)
        size = int(rng.integers(0, 300))
        listed = np.where(rng.random(size) < 0.7, rng.integers(0, n + 3, size), rng.integers(0, 2**32, size))
        items = [stamped(d, tokens.gateway(2, iteration))
                 for d in nack_packets(listed, job=JOB, iteration=iteration, per_packet=int(rng.integers(1, 257)))]
        core.datagrams_received(batch_of(items), 0.0)
        owed = {int(s) for s in listed if s < sent and not done[s] and s not in resent}
        got = [c for rows in resends(core) for c in chunks_of(rows)]
        assert sorted(got) == sorted(owed) and len(got) == len(set(got))


@pytest.fixture
def sender() -> Iterator[EdgeSender]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        yield EdgeSender(sock, ("127.0.0.1", 9), worker=2, layout=LAYOUT, job=JOB, secret=SECRET)
    finally:
        sock.close()


def keep_rows(iteration: int) -> np.ndarray:
    values = [np.arange(s, dtype=np.float32) / 7 for s in LAYOUT.sizes]
    return np.concatenate([data_packets(LAYOUT, job=JOB, worker=2, iteration=iteration, tensor=t, values=v)
                           for t, v in enumerate(values)])


def test_rows_sent_under_loss_are_the_kept_ones_in_order_without_copies(sender: EdgeSender) -> None:
    """Loss, drops and duplicates split a window into runs, each sent as a view of the model's rows; scattered
    rows are copied once. Either way exactly the kept rows leave, in order."""
    keep = keep_rows(1)
    rng = np.random.default_rng(4)
    for loss in (0.0, 0.01, 0.3, 0.9):
        sent: list[np.ndarray] = []

        async def capture(rows: np.ndarray, address: Any, sent: list[np.ndarray] = sent) -> None:
            sent.append(rows)

        sender.batch.send = capture  # type: ignore[method-assign]
        sender.loss, sender.duplicate = loss, 0.05
        sender.rng = np.random.default_rng(int(rng.integers(1 << 30)))
        state = sender.rng.bit_generator.state
        start, stop = int(rng.integers(0, 10)), int(rng.integers(20, LAYOUT.num_chunks + 1))
        asyncio.run(sender.send_rows(keep, np.arange(start, stop), first=True))
        # the same draws, by the rule stated directly
        sender.rng.bit_generator.state = state
        index = np.arange(start, stop)
        index = index[sender.rng.random(index.size) >= loss] if loss else index
        index = np.sort(np.concatenate([index, index[sender.rng.random(index.size) < 0.05]]))
        np.testing.assert_array_equal(np.concatenate(sent) if sent else keep[:0], keep[index])
        if loss <= 0.01:
            assert all(np.shares_memory(part, keep) for part in sent)


@pytest.fixture
def core() -> GatewayCore:
    return GatewayCore(LAYOUT, KernelMaps(LAYOUT), workers=4, job=JOB, userspace=False, port=0, secret=SECRET)


def test_the_agent_nacks_each_worker_once_listing_every_chunk_it_is_missing_from(core: GatewayCore) -> None:
    iteration = 1
    core.expect(iteration)
    sums = core.book.sums(iteration)
    states = cast(KernelMaps, core.aggregator).states
    rng = np.random.default_rng(7)
    bitmaps = {}
    for seq in range(LAYOUT.num_chunks):
        tensor, chunk = LAYOUT.locate(seq)
        bitmap = int(rng.integers(0, 16))
        bitmaps[seq] = bitmap
        states[seq % LAYOUT.num_slots] = (iteration, tensor, chunk, LAYOUT.scales[tensor], 1, bitmap)
    for w in range(4):
        hello(core, w, ("10.0.0.1", 5000 + w), secret=SECRET)
    sent(core)   # the HELLO answers
    asked = np.arange(0, LAYOUT.num_chunks, 2)
    core.nacks.missing(sums, None, asked, 0.0)
    core.nacks.missing(sums, None, asked[:5], 0.0)    # the same chunks again in the same wake-up: listed once
    core.nacks.flush(0.0)
    tokens = LanTokens(SECRET, JOB)
    got: dict[int, list[int]] = {}
    out = sent(core)
    for datagram, address in out:
        head = Header.decode(datagram)
        worker = address[1] - 5000
        assert head.kind == Kind.NACK and head.token == tokens.gateway(worker, iteration)
        got.setdefault(worker, []).extend(np.frombuffer(datagram, "<u4", head.count, HEADER_BYTES).tolist())
    # the gap rule: a worker missing from a slot's bitmap; a slot with nothing in it names every worker (every
    # datagram of a chunk below a completed one was lost)
    want = {w: [int(s) for s in asked if not bitmaps[int(s)] >> w & 1] for w in range(4)}
    assert got == {w: s for w, s in want.items() if s}
    assert core.nacks.nack_datagrams == len(out) == len(got)   # 24 chunks a worker fit one datagram
    # a slot holding another chunk names only the asker, who suspects its own datagram
    states[:] = np.zeros_like(states)
    core.nacks.missing(sums, 3, np.array([5, 6]), 0.0)
    core.nacks.flush(0.0)
    assert [(a[1] - 5000, np.frombuffer(d, "<u4", offset=HEADER_BYTES).tolist()) for d, a in sent(core)] == \
        [(3, [5, 6])]


# ---- in network namespaces, both aggregation paths ----

NS_LAYOUT = NACK_LAYOUT
NS_JOB = 13
PORT = 9420
GROUP = ("239.77.0.13", 9421)
WORKERS = 4
LOSER = 2
LOST = frozenset({3, 5, 6, 7, 40, 41})
_iterations = nack_iterations


@pytest.fixture(scope="module")
def xdp_program() -> Any:
    return nack_program()



async def run_lan(mode: str, xdp: Any, *, iterations: int, drop: frozenset[int] = frozenset(),
                  loss: float = 0.0) -> dict[str, Any]:
    """``iterations`` iterations of WORKERS workers; worker LOSER's first sends of ``drop`` are lost, and
    every worker loses ``loss`` of its first sends at random. The slot timers sit far beyond the run."""
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.emulation.netns import run_in

    rng = np.random.default_rng(11)
    with Lan(WORKERS) as lan:
        if xdp is not None:
            xdp.configure(job=NS_JOB, port=PORT, expected=(1 << WORKERS) - 1, timeout=10.0, max_nacks=20)
            ifindex = lan.gateway_ifindex()
            run_in(lan.gateway, lambda: xdp.attach(ifindex))
        try:
            agent = EdgeAgent(lan.udp_socket(lan.gateway, GATEWAY_IP, PORT), NS_LAYOUT, workers=WORKERS, job=NS_JOB,
                              mode=mode, xdp=xdp, slot_timeout=10.0, group=GROUP, retransmit=0.05,
                              query_nacks=True, secret=SECRET)
            nodes = [EdgeSender(lan.udp_socket(ns, lan.worker_ip(i)), (GATEWAY_IP, PORT), worker=i,
                                layout=NS_LAYOUT, job=NS_JOB, secret=SECRET, group_opener=lan.group_opener(ns),
                                loss=loss, seed=i)
                     for i, ns in enumerate(lan.workers)]
            nodes[LOSER].drop = drop
            nacks: list[tuple[int, list[int]]] = []
            control = agent.outbox.control

            def record(datagram: bytes, address: tuple[str, int]) -> bool:
                if datagram[OFFSETS["kind"]] == Kind.NACK:
                    head = Header.decode(datagram)
                    worker = next(w for w, a in agent.addresses.items() if a == address)
                    nacks.append((worker, np.frombuffer(datagram, "<u4", head.count, HEADER_BYTES).tolist()))
                return control(datagram, address)

            agent.outbox.control = record  # type: ignore[method-assign]
            sent = [list[int]() for _ in nodes]
            for node, log in zip(nodes, sent, strict=True):
                original = node.batch.send

                async def send(rows: np.ndarray, address: Any, original: Any = original, log: Any = log) -> None:
                    heads = np.frombuffer(np.ascontiguousarray(rows[:, :HEADER_BYTES]).tobytes(), HEADER_DTYPE)
                    log.extend(NS_LAYOUT.seq(int(t), int(c)) for t, c in zip(heads["tensor"], heads["chunk"],
                                                                            strict=True))
                    await original(rows, address)

                node.batch.send = send  # type: ignore[method-assign]
            runs = []
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(agent.run())
                try:
                    await asyncio.gather(*(n.hello(timeout=10) for n in nodes))
                    await agent.wait_workers(timeout=10)
                    for _ in range(iterations):
                        iteration = next(_iterations)
                        contribs = [[rng.standard_normal(s).astype(np.float32) for s in NS_LAYOUT.sizes]
                                    for _ in range(WORKERS)]
                        pushes = [tg.create_task(n.push_pull(iteration, contribs[n.worker], timeout=30))
                                  for n in nodes]
                        sums = await agent.collect(iteration, timeout=25)
                        await agent.send_results(iteration, sums, total=WORKERS)
                        runs.append((contribs, sums, [await task for task in pushes]))
                finally:
                    agent.close()
                    await serving
            stats = xdp.stats() if xdp is not None else dict(agent.fallback.counters)  # type: ignore[union-attr]
            return {"runs": runs, "nacks": nacks, "sent": sent, "stats": stats,
                    "nack_datagrams": agent.nack_datagrams, "dropped": [n.dropped for n in nodes],
                    "resent_by_nack": [n.resent_by_nack for n in nodes],
                    "resent": [n.retransmitted for n in nodes]}
        finally:
            if xdp is not None:
                xdp.detach()
                xdp.require_tokens(0)


def exact(contribs: list[list[np.ndarray]]) -> list[np.ndarray]:
    return fixed_point_sums(contribs, NS_LAYOUT.scales)


def assert_exact(runs: list[Any]) -> None:
    for contribs, sums, results in runs:
        want = exact(contribs)
        for got, ref in zip(sums, want, strict=True):
            assert np.array_equal(got, ref)
        for result, total in results:
            assert total == WORKERS
            for got, ref in zip(result, want, strict=True):
                assert np.array_equal(got, ref)


@pytest.mark.root
@pytest.mark.slow
def test_several_losses_of_one_worker_are_resent_exactly_once_on_listed_nacks(
        mode: str, request: pytest.FixtureRequest) -> None:
    xdp = request.getfixturevalue("xdp_program") if mode == "xdp" else None
    out = asyncio.run(run_lan(mode, xdp, iterations=1, drop=LOST))
    assert_exact(out["runs"])
    assert out["dropped"] == [len(LOST) if w == LOSER else 0 for w in range(WORKERS)]
    # every NACK named the loser and only chunks it lost; between them they listed every lost chunk
    assert out["nacks"] and {w for w, _ in out["nacks"]} == {LOSER}
    listed = [s for _, seqs in out["nacks"] for s in seqs]
    assert set(listed) == LOST
    assert out["nack_datagrams"] == len(out["nacks"])
    # each chunk went out once from every worker: the loser's lost ones once more, on the NACK, and no other
    for w, chunks in enumerate(out["sent"]):
        assert sorted(chunks) == list(range(NS_LAYOUT.num_chunks)), w
    assert out["resent_by_nack"] == [len(LOST) if w == LOSER else 0 for w in range(WORKERS)]
    assert out["stats"]["timer_events"] == 0


@pytest.mark.root
@pytest.mark.slow
def test_sums_stay_exact_under_one_percent_loss_with_listed_nacks(mode: str, request: pytest.FixtureRequest) -> None:
    xdp = request.getfixturevalue("xdp_program") if mode == "xdp" else None
    out = asyncio.run(run_lan(mode, xdp, iterations=4, loss=0.01))
    assert_exact(out["runs"])
    assert sum(out["dropped"]) > 0
    assert out["stats"]["timer_events"] == 0


def test_the_matrix_names_whom_the_per_chunk_rule_names_with_clusters() -> None:
    """Against the rule chunk by chunk (brute force): a missing unclustered worker is NACKed, a missing
    cluster aggregator is left to its service, a slot holding another chunk names only the asker (or its
    aggregator), and for the gap rule a slot with nothing of the chunk names everyone while a newer key names
    nobody; with random bitmaps, askers and newer slots."""
    from netstorm.lan.deploy import LanTopology

    topology = LanTopology(workers=6, clusters={0: (1, 2)})
    kernel = KernelMaps(LAYOUT)
    core = GatewayCore(LAYOUT, kernel, workers=6, job=JOB, userspace=False, port=0, topology=topology)
    expected = core.roster.expected
    core.expect(1)
    sums = core.book.sums(1)
    rng = np.random.default_rng(9)
    for _ in range(40):
        for seq in range(LAYOUT.num_chunks):
            tensor, chunk = LAYOUT.locate(seq)
            stale = rng.random() < 0.2
            kernel.states[seq % LAYOUT.num_slots] = (1 + stale, tensor, chunk, 0, 1,
                                                     int(rng.integers(0, 64)) & expected)
        asker = None if rng.random() < 0.3 else int(rng.integers(0, 6))
        seqs = np.unique(rng.integers(0, LAYOUT.num_chunks, int(rng.integers(1, 20))))
        want: dict[int, list[int]] = {}
        head = None if asker is None else topology.aggregator_of(asker)
        for seq in seqs.tolist():
            state = kernel.states[seq % LAYOUT.num_slots]
            here = int(state["iteration"]) == 1 and int(state["bitmap"]) != 0
            if here:
                left = expected & ~int(state["bitmap"])
            elif asker is not None:   # the asker, or its cluster's aggregator, suspects its own datagram
                left = 1 << (asker if head is None else head)
            elif int(state["bitmap"]) == 0:   # nothing of a chunk below a completed one: all were lost
                left = expected
            else:   # a newer key took the slot (and holds some of it): the chunk completed
                left = 0
            # a cluster aggregator is NACKed as a unit, at its service (not listed here)
            named = {w for w in range(6) if left >> w & 1 and w not in topology.clusters}
            for w in named:
                want.setdefault(w, []).append(seq)
        core.nacks.pending.clear()
        core.nacks.missing(sums, asker, seqs, 0.0)
        got = {w: np.unique(np.concatenate(parts)).tolist() for (_, w), parts in core.nacks.pending.items()}
        assert got == want
