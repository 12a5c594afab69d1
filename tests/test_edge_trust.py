"""The LAN tier as an attacker on the LAN would try it, on both aggregation paths: a gateway and two
workers on a bridge in network namespaces sharing a job secret, and a third party that does not know it.
A DATA datagram spoofed as worker 1, a forged AGG (from the wire or from a socket on the gateway itself)
and forged RESULT datagrams change no sum anyone receives; a spoofed or replayed HELLO does not take worker
1's results away, while worker 1 restarted on a new port is found again. The XDP program's own counter,
read from its kernel map, sees the spoofed DATA and the AGG from the wire. QUERY, REPORT, NACK and FAILED
with any wrong token are refused by the gateway and by the workers (those below a cluster aggregator, and
the aggregator's own service: tests/test_edge_cluster_nacks.py). Forged or stray datagrams of every kind
leave the gateway's memory flat, with and without a secret."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from netstorm.lan.downlink import DownlinkReport, report_packet
from netstorm.lan.errors import WireError
from netstorm.lan.header import HEADER_DTYPE, Kind
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import control_packet, data_packets, header_rows, nack_packets, result_packets
from netstorm.lan.tokens import LanTokens, Sender
from tests.dataplane import until

LAYOUT = EdgeLayout.uniform([3000, 7], scale=12, lanes=357)
JOB = 21
PORT = 9450
SECRET = b"the job secret, 32 bytes or more"
_iterations = itertools.count(50, 10)


@pytest.fixture(scope="module")
def xdp_program() -> Iterator[Any]:
    from bpf.xdp import XdpAggregator

    agg = XdpAggregator(LAYOUT, job=JOB, port=PORT, expected=0b11, timeout=0.1)
    yield agg
    agg.close()



def contributions(seed: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(s).astype(np.float32) for s in LAYOUT.sizes] for _ in range(2)]


def reference(contribs: list[list[np.ndarray]]) -> list[np.ndarray]:
    """The exact LAN sums at the layout's scale."""
    out = []
    for t in range(len(LAYOUT.sizes)):
        total = np.sum([np.rint(w[t].astype(np.float64) * 2.0**12).astype(np.int64) for w in contribs], axis=0)
        out.append((total.astype(np.float64) * 2.0**-12).astype(np.float32))
    return out


def forged_data(iteration: int, worker: int, token: int) -> list[bytes]:
    """DATA as ``worker`` with large values that would show in any sum they reached."""
    return [bytes(row) for t, size in enumerate(LAYOUT.sizes)
            for row in data_packets(LAYOUT, job=JOB, worker=worker, iteration=iteration, tensor=t,
                                    values=np.full(size, 1000.0), token=token)]


def as_agg(datagram: bytes, token: int) -> bytes:
    out = bytearray(datagram)
    head = np.frombuffer(out, HEADER_DTYPE, count=1)
    head["kind"], head["token"] = int(Kind.AGG), token
    return bytes(out)


class Scene:
    """A running agent, two workers with the secret, and an attacker socket in worker 1's namespace."""

    def __init__(self, lan: Any, agent: Any, nodes: list[Any], attacker: socket.socket, xdp: Any) -> None:
        self.lan, self.agent, self.nodes, self.attacker, self.xdp = lan, agent, nodes, attacker, xdp

    async def send(self, datagrams: list[bytes], to: tuple[str, int], sock: socket.socket | None = None) -> None:
        from netstorm.lan.udp import sendto

        for datagram in datagrams:
            await sendto(sock or self.attacker, datagram, to)

    async def iteration(self, iteration: int, seed: int, *, before_results: Callable[[], Any] | None = None,
                        within: float = 15) -> None:
        """One iteration: both workers push, the gateway's sum and every worker's result are exact."""
        contribs = contributions(seed)
        expected = reference(contribs)
        pushes = [asyncio.create_task(n.push_pull(iteration, contribs[n.worker], timeout=20)) for n in self.nodes]
        sums = await self.agent.collect(iteration, timeout=within)
        for got, want in zip(sums, expected, strict=True):
            np.testing.assert_array_equal(got, want)
        if before_results is not None:
            await before_results()
        await self.agent.send_results(iteration, sums, total=2)
        for task in pushes:
            got_sums, total = await task
            assert total == 2
            for got, want in zip(got_sums, expected, strict=True):
                np.testing.assert_array_equal(got, want)


async def in_scene(mode: str, xdp: Any, play: Callable[[Scene], Any]) -> None:
    from bpf.agent import EdgeAgent
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.emulation.netns import run_in
    from netstorm.lan.sender import EdgeSender

    with Lan(2) as lan:
        if mode == "xdp":
            xdp.configure(job=JOB, port=PORT, expected=0b11, timeout=0.1, max_nacks=20)
            ifindex = lan.gateway_ifindex()
            run_in(lan.gateway, lambda: xdp.attach(ifindex))
        try:
            agent = EdgeAgent(lan.udp_socket(lan.gateway, GATEWAY_IP, PORT), LAYOUT, workers=2, job=JOB, mode=mode,
                              xdp=xdp if mode == "xdp" else None, slot_timeout=0.1, secret=SECRET)
            nodes = [EdgeSender(lan.udp_socket(ns, lan.worker_ip(i)), (GATEWAY_IP, PORT), worker=i, layout=LAYOUT,
                                job=JOB, secret=SECRET) for i, ns in enumerate(lan.workers)]
            attacker = lan.udp_socket(lan.workers[1], lan.worker_ip(1))
            scene = Scene(lan, agent, nodes, attacker, xdp if mode == "xdp" else None)
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(agent.run())
                try:
                    await asyncio.gather(*(n.hello(timeout=10) for n in nodes))
                    await agent.wait_workers(timeout=10)
                    await play(scene)
                finally:
                    agent.close()
                    await serving
            for sock in (agent.sock, attacker, *(n.sock for n in nodes)):
                sock.close()
        finally:
            if mode == "xdp":
                xdp.detach()
                xdp.require_tokens(0)


def program(mode: str, request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue("xdp_program") if mode == "xdp" else None


@pytest.mark.root
@pytest.mark.slow
def test_data_spoofed_as_worker_1_changes_no_sum_and_the_kernel_counts_it(mode: str,
                                                                         request: pytest.FixtureRequest) -> None:
    from netstorm.emulation.bridge_lan import GATEWAY_IP

    async def play(scene: Scene) -> None:
        iteration = next(_iterations)
        scene.agent.expect(iteration)   # what a collect or the previous result does: its tokens are in place
        forged = forged_data(iteration, worker=1, token=0x5EC12E7)
        await scene.send(forged, (GATEWAY_IP, PORT))
        await until(lambda: scene.agent.bad_tokens >= len(forged), "dropping the spoofed DATA")
        if scene.xdp is not None:   # the program's own counter, summed over CPUs from its map
            assert scene.xdp.stats()["bad_token"] >= len(forged)
        await scene.iteration(iteration, seed=1)

    asyncio.run(in_scene(mode, program(mode, request), play))


@pytest.mark.root
@pytest.mark.slow
def test_data_of_a_worker_two_iterations_ahead_is_refused_and_stalls_no_window(mode: str,
                                                                             request: pytest.FixtureRequest) -> None:
    from netstorm.emulation.bridge_lan import GATEWAY_IP

    async def play(scene: Scene) -> None:
        iteration = next(_iterations)
        scene.agent.expect(iteration)
        # worker 1's own token for iteration k+2 (installed: the token window spans 8), with values that would
        # show in any sum they reached
        ahead = forged_data(iteration + 2, worker=1, token=LanTokens(SECRET, JOB).worker(1, iteration + 2))
        await scene.send(ahead, (GATEWAY_IP, PORT))
        await until(lambda: scene.agent.future_refused >= len(ahead), "refusing DATA two iterations ahead")
        for k in range(iteration, iteration + 3):   # each exact, within a few slot periods (no stall)
            await scene.iteration(k, seed=k, within=3)

    asyncio.run(in_scene(mode, program(mode, request), play))


@pytest.mark.root
@pytest.mark.slow
def test_forged_agg_and_result_change_nothing_the_workers_receive(mode: str, request: pytest.FixtureRequest) -> None:
    from netstorm.emulation.bridge_lan import GATEWAY_IP

    async def play(scene: Scene) -> None:
        iteration = next(_iterations)
        scene.agent.expect(iteration)
        aggs = [as_agg(d, token=0x1234) for d in forged_data(iteration, worker=0, token=0)]
        # from the wire (the XDP program sees it first), and from a socket on the gateway itself (it does not)
        local = scene.lan.udp_socket(scene.lan.gateway, "127.0.0.1")
        try:
            await scene.send(aggs, (GATEWAY_IP, PORT))
            await scene.send(aggs, (GATEWAY_IP, PORT), sock=local)
            await until(lambda: scene.agent.bad_tokens + scene.agent.errors >= 2 * len(aggs), "refusing forged AGG")
        finally:
            local.close()
        if scene.xdp is not None:
            assert scene.xdp.stats()["bad_token"] >= len(aggs)

        async def forge_results() -> None:
            wrong = [np.full(size, 7.0, np.float32) for size in LAYOUT.sizes]
            rows = [bytes(r) for t, v in enumerate(wrong)
                    for r in result_packets(LAYOUT, job=JOB, iteration=iteration, tensor=t, values=v, total=99)]
            for node in scene.nodes:
                await scene.send(rows, node.sock.getsockname())
            await until(lambda: all(n.forged >= len(rows) for n in scene.nodes), "workers dropping forged RESULT")

        await scene.iteration(iteration, seed=2, before_results=forge_results)

    asyncio.run(in_scene(mode, program(mode, request), play))


@pytest.mark.root
@pytest.mark.slow
def test_a_spoofed_hello_steals_nothing_and_a_restarted_worker_is_found_again(
        mode: str, request: pytest.FixtureRequest) -> None:
    from netstorm.emulation.bridge_lan import GATEWAY_IP
    from netstorm.lan.sender import EdgeSender
    from netstorm.lan.tokens import LanTokens

    async def play(scene: Scene) -> None:
        real = scene.nodes[1].sock.getsockname()
        spoofed = [control_packet(Kind.HELLO, job=JOB, worker=1, iteration=n, token=0xBAD + n) for n in range(3)]
        await scene.send(spoofed, (GATEWAY_IP, PORT))
        await until(lambda: scene.agent.bad_tokens >= 3, "refusing the spoofed HELLO")
        assert scene.agent.addresses[1] == real
        await scene.iteration(next(_iterations), seed=3)   # worker 1 still receives its results
        # worker 1 restarts on a new port: its HELLO carries a valid token, so the gateway follows it
        restarted = EdgeSender(scene.lan.udp_socket(scene.lan.workers[1], scene.lan.worker_ip(1)),
                               (GATEWAY_IP, PORT), worker=1, layout=LAYOUT, job=JOB, secret=SECRET)
        scene.nodes[1].sock.close()
        scene.nodes[1] = restarted
        await restarted.hello(timeout=10)
        assert scene.agent.addresses[1] == restarted.sock.getsockname()
        # a HELLO it sent, replayed from another address, is refused
        nonce = 777
        genuine = control_packet(Kind.HELLO, job=JOB, worker=1, iteration=nonce,
                                 token=LanTokens(SECRET, JOB).worker(1, nonce))
        await scene.send([genuine], (GATEWAY_IP, PORT), sock=restarted.sock)
        await until(lambda: nonce in scene.agent.roster.nonces(1), "the worker's own HELLO")
        before = scene.agent.bad_tokens
        await scene.send([genuine], (GATEWAY_IP, PORT))
        await until(lambda: scene.agent.bad_tokens > before, "refusing the replayed HELLO")
        assert scene.agent.addresses[1] == restarted.sock.getsockname()
        await scene.iteration(next(_iterations), seed=4)

    asyncio.run(in_scene(mode, program(mode, request), play))


def wrong_tokens(tokens: LanTokens, worker: int, iteration: int, sender: Sender) -> dict[str, int]:
    """Tokens a datagram of ``sender`` (as ``worker``, for ``iteration``) must not be taken with, each one an
    attacker on the LAN can hold: none, a guess, the group's token of the iteration before (every ACK and
    RESULT multicast carries it), the other direction's token (a gateway's answer to this worker, or this
    worker's own DATA), and another worker's."""
    other = Sender.GATEWAY if sender == Sender.WORKER else Sender.WORKER
    return {"unsigned": 0, "guessed": 0x5EC12E7, "group's of the iteration before": tokens.group(iteration - 1),
            "the other direction's": tokens.of(other, worker, iteration),
            "another worker's": tokens.of(sender, 1 - worker, iteration)}


FORGED_BYTES = 987_654_321
"""What a forged downlink REPORT claims (no genuine result burst is this size)."""


def query_packet(iteration: int, worker: int, token: int) -> bytes:
    """A QUERY listing every chunk of the layout."""
    head = header_rows(1, kind=Kind.QUERY, job=JOB, worker=worker, iteration=iteration, token=token)
    head["count"], head["need"] = LAYOUT.num_chunks, 127
    return head.tobytes() + np.arange(LAYOUT.num_chunks, dtype="<u4").tobytes()


@pytest.mark.root
@pytest.mark.slow
def test_forged_query_report_nack_and_failed_are_refused_by_the_gateway_and_the_workers(
        mode: str, request: pytest.FixtureRequest) -> None:
    """QUERY and REPORT (to the gateway) and NACK and FAILED (to the workers) with any token but the right
    one are counted and dropped, whatever wrong token they carry: the gateway answers no forged QUERY (whose
    answer would be ACKs and NACKs for every chunk) and keeps no forged downlink report; no worker resends on
    a forged NACK or ends its iteration on a forged FAILED; NACK and FAILED sent to the gateway are refused
    as kinds it never takes. The sums of the iterations around them stay exact."""
    from netstorm.emulation.bridge_lan import GATEWAY_IP

    tokens = LanTokens(SECRET, JOB)

    async def play(scene: Scene) -> None:
        first = next(_iterations)
        await scene.iteration(first, seed=5)   # finished at the gateway: a QUERY or REPORT about it is heard
        forged, errors = scene.agent.forged, scene.agent.errors
        upward = [datagram for token in wrong_tokens(tokens, 1, first, Sender.WORKER).values()
                  for datagram in (query_packet(first, 1, token),
                                   report_packet(DownlinkReport(FORGED_BYTES, 10**6), job=JOB, worker=1,
                                                 iteration=first, token=token))]
        strays = [control_packet(kind, job=JOB, worker=1, iteration=first, token=tokens.gateway(1, first))
                  for kind in (Kind.NACK, Kind.FAILED)]
        await scene.send(upward + strays, (GATEWAY_IP, PORT))
        await until(lambda: scene.agent.forged - forged >= len(upward) and scene.agent.errors - errors >= len(strays),
                    "the gateway refusing forged QUERY, REPORT, NACK and FAILED")
        assert scene.agent.forged - forged == len(upward)
        assert all(nbytes != FORGED_BYTES for _, nbytes, _, _ in scene.agent.downlink_bursts())
        second = next(_iterations)
        downward: dict[int, list[bytes]] = {}
        for node in scene.nodes:
            downward[node.worker] = [
                datagram for token in wrong_tokens(tokens, node.worker, second, Sender.GATEWAY).values()
                for datagram in (*nack_packets(np.arange(LAYOUT.num_chunks), job=JOB, iteration=second, token=token),
                                 control_packet(Kind.FAILED, job=JOB, worker=node.worker, iteration=second,
                                                token=token))]
            # queued at the worker before its iteration starts: its first receive takes them with the ACKs
            await scene.send(downward[node.worker], node.sock.getsockname())
        before = [(n.forged, n.resent_by_nack) for n in scene.nodes]
        await scene.iteration(second, seed=6)   # exact, and no worker aborted
        for node, (was_forged, was_resent) in zip(scene.nodes, before, strict=True):
            assert node.forged - was_forged == len(downward[node.worker])
            assert node.resent_by_nack == was_resent

    asyncio.run(in_scene(mode, program(mode, request), play))


def forged_stream(kind: Kind, count: int, start: int) -> Iterator[bytes]:
    """Well-formed datagrams of ``kind`` for ``count`` iterations from ``start``, with wrong tokens."""
    rng = np.random.default_rng(start)
    for k in range(start, start + count):
        t = int(rng.integers(len(LAYOUT.sizes)))
        c = int(rng.integers(LAYOUT.chunks[t]))
        if kind == Kind.PULL:
            yield control_packet(Kind.PULL, job=JOB, worker=int(rng.integers(2)), iteration=k, tensor=t, chunk=c,
                                 token=k)
            continue
        row = bytes(data_packets(LAYOUT, job=JOB, worker=int(rng.integers(2)), iteration=k, tensor=t,
                                 values=np.ones(LAYOUT.sizes[t]), chunks=np.array([c]), token=k)[0])
        yield as_agg(row, token=k) if kind == Kind.AGG else row


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
@pytest.mark.parametrize(("path", "kinds"), [
    pytest.param("xdp", (Kind.AGG, Kind.PULL), marks=[pytest.mark.root, pytest.mark.bcc, pytest.mark.slow]),
    ("userspace", (Kind.DATA, Kind.PULL, Kind.AGG)),
])
def test_thousands_of_forged_datagrams_leave_the_gateway_memory_flat(path: str, kinds: tuple[Kind, ...],
                                                                    secret: bytes | None,
                                                                    request: pytest.FixtureRequest) -> None:
    """Each of these datagrams names a new iteration; the agent keeps state for the window of iterations
    it expects and no more, so memory after 3000 of them is what it was after the first 300."""
    from bpf.agent import EdgeAgent

    xdp = request.getfixturevalue("xdp_program") if path == "xdp" else None
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        agent = EdgeAgent(sock, LAYOUT, workers=2, job=JOB, mode=path, xdp=xdp, slot_timeout=0.1, secret=secret)
        agent.expect(1000)

        def feed(count: int, start: int) -> None:
            for kind in kinds:
                for datagram in forged_stream(kind, count, start):
                    with contextlib.suppress(WireError):
                        agent.core.datagram(datagram, ("10.77.0.99", 5000), 0.0)

        tracemalloc.start()
        try:
            feed(100, 1000)   # the window's own iterations, then far beyond it
            before = tracemalloc.get_traced_memory()[0]
            feed(1000, 1100)
            after = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        per_iteration = LAYOUT.num_slots * LAYOUT.lanes * 4
        assert after - before < 4 * per_iteration, (after - before, per_iteration)
        assert len(agent.core.book.open) <= 8 and agent.outbox.pending == 0
    finally:
        sock.close()
        if xdp is not None:
            xdp.require_tokens(0)


@pytest.mark.root
@pytest.mark.slow
def test_edge_clients_with_the_secret_train_and_one_without_it_is_not_admitted(mode: str,
                                                                               request: pytest.FixtureRequest) -> None:
    """The trainer API end to end (``aconnect_edge(..., secret=...)``): init hands both workers the
    gateway's values and push_pull returns the exact sum; a worker holding another secret gets no answer
    to its HELLO, so its init fails as a gateway that cannot be reached."""
    from netstorm.emulation.bridge_lan import GATEWAY_IP
    from netstorm.errors import NodeGone
    from netstorm.lan.client import AsyncEdgeClient

    def model(seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {"a": rng.integers(-50, 50, LAYOUT.sizes[0]).astype(np.float32),
                "b": rng.integers(-50, 50, LAYOUT.sizes[1]).astype(np.float32)}

    async def play(scene: Scene) -> None:
        clients = [AsyncEdgeClient((GATEWAY_IP, PORT), i, job=JOB, timeout=15, secret=SECRET,
                                   sock=scene.lan.udp_socket(ns, scene.lan.worker_ip(i)))
                   for i, ns in enumerate(scene.lan.workers)]
        outsider = AsyncEdgeClient((GATEWAY_IP, PORT), 0, job=JOB, timeout=1.5, secret=b"x" * 32,
                                   sock=scene.lan.udp_socket(scene.lan.workers[0], scene.lan.worker_ip(0)))
        before = scene.agent.bad_tokens
        with pytest.raises(NodeGone, match="did not answer HELLO"):
            await outsider.init(model(0))
        assert scene.agent.bad_tokens > before
        await outsider.close()
        start = next(_iterations)
        inits = [asyncio.create_task(c.init(model(100 + c.worker_id))) for c in clients]
        await until(lambda: all(scene.agent.addresses.get(c.worker_id) == c.sock.getsockname() for c in clients),
                    "the clients' HELLO")
        await scene.agent.send_results(start, [model(0)["a"], model(0)["b"]], total=2)
        for task in inits:
            got = await task
            np.testing.assert_array_equal(got["a"], model(0)["a"])
        inputs = [model(1 + c.worker_id) for c in clients]
        pushes = [asyncio.create_task(c.push_pull(x)) for c, x in zip(clients, inputs, strict=True)]
        sums = await scene.agent.collect(start + 1, timeout=15)
        await scene.agent.send_results(start + 1, sums, total=2)
        for task in pushes:
            got = await task
            for name in ("a", "b"):
                np.testing.assert_array_equal(got[name], inputs[0][name] + inputs[1][name])
        for c in clients:
            await c.close()

    asyncio.run(in_scene(mode, program(mode, request), play))
