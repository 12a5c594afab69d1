"""Recovery below two LAN levels, by plain calls into the gateway's core and a fake clock: a chunk lost in
two clusters at once is NACKed to both cluster aggregators at once, and a cluster whose answer was lost is
NACKed again on its member's next QUERY a hold later (doubling with each repeat), not a slot-timer period
later. The gateway's slot timers run at the benchmark's period (2 s) and never fire here: every recovery is
the NACK rule's. And a member's QUERY says its HELLO to its aggregator again, so a lost first HELLO cannot
leave the aggregator unable to NACK it."""

from __future__ import annotations

import asyncio
import socket

import numpy as np

from bpf.fallback import UserspaceAggregator
from netstorm.lan.deploy import LanTopology
from netstorm.lan.gatewaycore import GatewayCore
from netstorm.lan.gatewaynacks import CLUSTER_NACK_HOLD
from netstorm.lan.header import HEADER_BYTES, Flag, Header, Kind
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import control_packet, data_packets, header_rows
from netstorm.lan.sender import EdgeSender
from netstorm.lan.tokens import LanTokens, Sender
from netstorm.lan.udp import recvfrom_into
from tests.lan_gateway import KernelMaps, sent

LAYOUT = EdgeLayout.uniform([640], scale=10, lanes=64)
"""10 chunks."""
JOB = 3
TOPOLOGY = LanTopology(workers=4, clusters={0: (2,), 1: (3,)})
SERVICE = {0: ("10.0.0.10", 9000), 1: ("10.0.0.11", 9000)}
"""Where each cluster aggregator's service says HELLO from (its NACKs go there)."""
TRAINER = {w: (f"10.0.0.{10 + w}", 6000) for w in range(4)}
SLOT_TIMEOUT = 2.0
RETRANSMIT = 0.005
LOST = 3


def gateway() -> GatewayCore:
    fallback = UserspaceAggregator(LAYOUT, job=JOB, expected=TOPOLOGY.gateway_mask(), timeout=SLOT_TIMEOUT)
    core = GatewayCore(LAYOUT, fallback, workers=4, job=JOB, userspace=True, port=9000, topology=TOPOLOGY,
                       retransmit=RETRANSMIT)
    for head, address in SERVICE.items():
        core.datagram(control_packet(Kind.HELLO, job=JOB, worker=head, iteration=11, flags=Flag.AGGREGATOR),
                      address, 0.0)
    for worker, address in TRAINER.items():
        core.datagram(control_packet(Kind.HELLO, job=JOB, worker=worker, iteration=12), address, 0.0)
    sent(core)
    return core


def aggregate(head: int, iteration: int, values: np.ndarray, seqs: list[int]) -> list[bytes]:
    """Cluster ``head``'s aggregates of chunks ``seqs``: its service forwards each as the head's own DATA."""
    rows = data_packets(LAYOUT, job=JOB, worker=head, iteration=iteration, tensor=0, values=values)
    return [bytes(rows[seq]) for seq in seqs]


def cluster_nacks(core: GatewayCore, now: float) -> dict[int, list[int]]:
    """The chunks the core NACKed to each cluster aggregator's service since the last look."""
    out: dict[int, list[int]] = {}
    for data, address in sent(core, now):
        head = next((h for h, a in SERVICE.items() if a == address), None)
        if head is not None and Header.decode(data).kind == Kind.NACK:
            out.setdefault(head, []).append(int(np.frombuffer(data, "<u4", 1, HEADER_BYTES)[0]))
    return out


def query(core: GatewayCore, worker: int, iteration: int, seqs: list[int], now: float) -> None:
    """``worker`` asks which of ``seqs`` completed, as a worker's gap rule does (its QUERY)."""
    head = header_rows(1, kind=Kind.QUERY, job=JOB, worker=worker, iteration=iteration)
    head["count"], head["need"] = len(seqs), 127
    core.datagram(head.tobytes() + np.array(seqs, "<u4").tobytes(), TRAINER[worker], now)
    core.flush(now)


def test_a_chunk_lost_in_both_clusters_is_nacked_to_both_at_once_and_again_on_the_next_query() -> None:
    core = gateway()
    rng = np.random.default_rng(4)
    iteration = 1
    core.expect(iteration)
    values = {head: rng.standard_normal(LAYOUT.sizes[0]).astype(np.float32) for head in SERVICE}
    others = [seq for seq in range(LAYOUT.num_chunks) if seq != LOST]
    now = 0.01
    for head in SERVICE:   # every aggregate but chunk LOST's, which neither cluster completed
        for datagram in aggregate(head, iteration, values[head], others):
            core.datagram(datagram, SERVICE[head], now)
    core.flush(now)
    # the gap rule: nothing of chunk LOST reached the gateway below completed chunks, so both clusters are
    # missing from it and each one's service is NACKed now (not one, the other held for the hold)
    assert cluster_nacks(core, now) == {0: [LOST], 1: [LOST]}
    # cluster 0's answer comes; cluster 1's is lost (its member's resend, or the aggregate)
    now += 0.004
    core.datagram(aggregate(0, iteration, values[0], [LOST])[0], SERVICE[0], now)
    core.flush(now)
    assert core.book.sums(iteration).open.sum() == 1
    # within the hold a member's QUERY repeats nothing (every member asks; the service is already at it)
    query(core, 3, iteration, [LOST], now)
    assert cluster_nacks(core, now) == {}
    # its next QUERY, a hold later, NACKs the cluster again: long before the slot timer's period
    now += max(RETRANSMIT, CLUSTER_NACK_HOLD) + 0.001
    assert now < SLOT_TIMEOUT / 10
    query(core, 3, iteration, [LOST], now)
    assert cluster_nacks(core, now) == {1: [LOST]}
    # a repeat doubles the hold (a busy service is not flooded): held a hold later, sent two holds later
    hold = max(RETRANSMIT, CLUSTER_NACK_HOLD)
    query(core, 3, iteration, [LOST], now + 1.5 * hold)
    assert cluster_nacks(core, now) == {}
    now += 2 * hold + 0.001
    query(core, 3, iteration, [LOST], now)
    assert cluster_nacks(core, now) == {1: [LOST]}
    core.datagram(aggregate(1, iteration, values[1], [LOST])[0], SERVICE[1], now + 0.004)
    sums = core.book.sums(iteration)
    assert sums.done
    want = np.sum([np.rint(values[h].astype(np.float64) * 2.0**10) for h in SERVICE], axis=0) * 2.0**-10
    np.testing.assert_array_equal(sums.result()[0], want.astype(np.float32))


def test_a_member_whose_first_hello_to_its_aggregator_was_lost_says_it_again_with_each_query() -> None:
    """The aggregator learns where a member is only from the member's HELLO, and a gap is only asked about
    (the stall rule never resends a chunk that each QUERY asks about again): were that one HELLO lost, the
    aggregator could never NACK the member, and the chunk would wait until the iteration timed out. A QUERY
    now carries the HELLO along to the aggregator. On loopback, with the gateway's core answering HELLO."""
    async def body() -> None:
        socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(3)]
        gw, agg, member = socks
        try:
            for sock in socks:
                sock.bind(("127.0.0.1", 0))
                sock.setblocking(False)
            topology = LanTopology(workers=2, clusters={0: (1,)})
            # an aggregator listens on the gateway's port of its own host: members send there
            core = GatewayCore(LAYOUT, KernelMaps(LAYOUT), workers=2, job=JOB, userspace=False,
                               port=agg.getsockname()[1], topology=topology, secret=b"s" * 32)
            tokens = LanTokens(b"s" * 32, JOB)
            core.datagram(control_packet(Kind.HELLO, job=JOB, worker=0, iteration=5, flags=Flag.AGGREGATOR,
                                         token=tokens.of(Sender.WORKER, 0, 5, keep=False)), agg.getsockname(), 0.0)
            sent(core)
            node = EdgeSender(member, gw.getsockname(), worker=1, layout=LAYOUT, job=JOB, secret=b"s" * 32,
                              group_opener=lambda group, local: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
            buf = bytearray(4096)

            async def gateway() -> None:   # answers the member's HELLO as the gateway does
                n, address = await recvfrom_into(gw, buf)
                core.datagram(bytes(buf[:n]), address, 0.0)
                for data, to in sent(core):
                    gw.sendto(data, to)

            serving = asyncio.create_task(gateway())
            await node.hello(timeout=5)
            await serving
            assert node.deployment is not None and node.deployment.send_to == agg.getsockname()
            n, _ = await asyncio.wait_for(recvfrom_into(agg, buf), 5)   # the first HELLO: taken as lost
            first = bytes(buf[:n])
            hello = Header.decode(first)
            assert hello.kind == Kind.HELLO and hello.worker == 1
            assert tokens.valid(Sender.WORKER, 1, hello.iteration, hello.token, keep=False)
            # the sender core says it again with each QUERY (next test)
            assert node.core.hello_again == first
            node.close()
        finally:
            for sock in socks:
                sock.close()

    asyncio.run(body())


def test_the_sender_core_sends_its_hello_to_its_aggregator_before_each_query() -> None:
    """A plain-call check of the rule above: with ``hello_again`` set, the QUERY a gap makes goes to the
    gateway right after the HELLO goes to where DATA goes (the aggregator)."""
    from netstorm.lan.senderactions import SendControl
    from netstorm.lan.sendercore import SenderCore

    core = SenderCore(worker=1, job=JOB, tokens=LanTokens(None, JOB), retransmit=0.005, query_nacks=True,
                      pull_interval=0.5)
    core.hello_again = b"hello-bytes"
    tensors = [np.ones(size, np.float32) for size in LAYOUT.sizes]
    core.push(1, tensors, layout=LAYOUT, now=0.0, timeout=30.0)
    core.actions()
    for when in (0.5, 1.0, 2.0, 4.0):   # the stall rule asks about the oldest chunks, again and again
        core.handle_timer(when)
        controls = [a for a in core.actions() if isinstance(a, SendControl)]
        queries = [i for i, a in enumerate(controls)
                   if not a.aggregator and Header.decode(a.datagram).kind == Kind.QUERY]
        assert queries, when
        first = queries[0]
        assert first > 0 and controls[first - 1] == SendControl(b"hello-bytes", aggregator=True), controls
