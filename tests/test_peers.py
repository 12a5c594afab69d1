"""The TCP data plane: in-process nodes on loopback under fixed policies.

Exact sums over several iterations; garbage, strangers and oversized frames rejected while the node
keeps serving; a dead peer and a stuck iteration fail with errors naming peer and iteration;
back-pressure keeps a slow link's bytes in its queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import struct
from collections.abc import Callable

import msgspec
import numpy as np
import pytest
import uvloop

from netstorm.config import Config
from netstorm.control import LinkBeliefs
from netstorm.errors import ErrorCode
from netstorm.frames import MAGIC, PREFIX, PREFIX_SIZE, VERSION, ChunkHeader, ErrorFrame, Hello, Kind, Phase
from netstorm.layout import TensorSpec
from netstorm.planning.plan import plan
from netstorm.policy import Policy
from netstorm.sendsched import LinkView
from node.peers import Outgoing, PeerError, PeerLink
from node.service import GeneralNode, IterationTimeout, PeerGone
from tests.dataplane import FixedControl, cluster, until

RATES = {(1, 2): 50.0, (2, 1): 40.0, (2, 3): 80.0, (3, 2): 60.0, (3, 4): 30.0, (4, 3): 35.0,
         (4, 1): 90.0, (1, 4): 70.0, (1, 3): 20.0, (3, 1): 25.0}
SPECS = [TensorSpec("conv", (40, 30), "float32"), TensorSpec("fc", (2500,), "float32"),
         TensorSpec("bias", (7,), "float32"), TensorSpec("scale", (1,), "float32")]
CONFIG = Config(chunk_size=500, iteration_timeout=20.0, connect_timeout=5.0)
MESH = [1, 2, 3, 4]


def rollout(nodes: list[int]) -> Callable[[int], Policy]:
    """A new policy (and topology) every iteration: rollouts between iterations lose nothing."""
    rates = {(a, b): r for (a, b), r in RATES.items() if a in nodes and b in nodes}

    def policy(iteration: int) -> Policy:
        return plan(rates, topology=["fapt", "star", "mst", "fapt1"][iteration % 4], version=iteration)
    return policy


async def one_iteration(nodes: dict[int, GeneralNode], values: dict[int, np.ndarray],
                        pushed: Callable[[GeneralNode], None] | None = None) -> dict[int, np.ndarray]:
    """One iteration on every node; ``pushed(node)`` runs right after the node's contributions, before
    any of its link tasks ran (so their chunks are still queued)."""
    async def run(node: GeneralNode) -> np.ndarray:
        layout = node.layout
        assert layout is not None
        flat = values[node.node_id]
        for key in range(len(layout.tensors)):
            await node.contribute(key, flat[layout.key_slice(key)])
        if pushed is not None:
            pushed(node)
        out = np.full(layout.total, np.nan, dtype=np.float32)

        def sink(key: int, result: np.ndarray) -> None:
            out[layout.key_slice(key)] = result
        await node.collect(list(range(len(layout.tensors))), sink)
        return out

    results = await asyncio.gather(*(run(n) for n in nodes.values()))
    return dict(zip(nodes, results, strict=True))


def test_exact_sums_over_several_iterations_and_policy_changes():
    async def main() -> None:
        async with cluster([1, 2, 3, 4], CONFIG, rollout([1, 2, 3, 4])) as nodes:
            for node in nodes.values():
                await node.register(SPECS)
            rng = np.random.default_rng(0)
            total = nodes[1].layout.total  # type: ignore[union-attr]
            for _ in range(4):
                values = {i: rng.integers(-500, 500, total).astype(np.float32) for i in nodes}
                results = await one_iteration(nodes, values)
                expected = np.sum(list(values.values()), axis=0, dtype=np.float32)
                for out in results.values():
                    np.testing.assert_array_equal(out, expected)
            assert all(n.core.chunks.live_iterations() == [] for n in nodes.values())
            # Each node asked for iteration k+1's policy when k completed there, and only then (binding
            # k+1 as late as possible, to the newest policy).
            for node in nodes.values():
                assert isinstance(node.control, FixedControl)
                assert node.control.prefetched == [1, 2, 3, 4]
    uvloop.run(main())


def raw_send(port: int, data: bytes) -> bytes:
    """Send bytes to a node's data port; return what it answers before closing."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        chunks: list[bytes] = []
        while True:
            part = s.recv(65536)
            if not part:
                return b"".join(chunks)
            chunks.append(part)


def error_frame(reply: bytes) -> ErrorFrame:
    magic, _, kind, header_len, _ = PREFIX.unpack_from(reply)
    assert magic == MAGIC and kind == Kind.ERROR
    return ErrorFrame.decode(reply[PREFIX_SIZE:PREFIX_SIZE + header_len])


def error_message(reply: bytes) -> str:
    return error_frame(reply).message


def test_bad_frames_are_rejected_and_the_node_keeps_serving():
    async def main() -> None:
        async with cluster([1, 2, 3], CONFIG, rollout([1, 2, 3])) as nodes:
            for node in nodes.values():
                await node.register(SPECS)
            port = nodes[2]._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            layout_hash = nodes[2].layout.hash  # type: ignore[union-attr]
            chunk = ChunkHeader(0, 0, 1, Phase.UP, 1, 2, 1, 2, 0, 0.0, False, (1, 2), 10)
            cases = {
                b"GET / HTTP/1.1\r\nHost: x\r\n\r\n": "bad magic",
                Hello(9, layout_hash).encode(): "not a member",
                Hello(1, "0123456789abcdef").encode(): "layout mismatch",
                chunk.encode() + bytes(40): "chunk before Hello",
                Hello(1, layout_hash).encode() + PREFIX.pack(MAGIC, VERSION, Kind.CHUNK, 10, 1 << 30): "exceeds",
                Hello(1, layout_hash).encode() + PREFIX.pack(MAGIC, VERSION, 42, 1, 0) + b"x": "unknown frame kind",
                Hello(1, layout_hash).encode() + chunk.encode() + bytes(40): "layout says",
                Hello(3, layout_hash).encode() + chunk.encode() + bytes(40): "claims to come from node 1",
                Hello(1, layout_hash).encode() + struct.pack("<4sBBII", MAGIC, VERSION, Kind.CHUNK, 3, 0)
                + b"\x92\x01\x02": "Expected `object`, got `array`",
            }
            codes = {"bad magic": ErrorCode.MALFORMED, "layout mismatch": ErrorCode.LAYOUT_MISMATCH,
                     "Expected `object`, got `array`": ErrorCode.MALFORMED, "layout says": ErrorCode.PROTOCOL}
            for data, message in cases.items():
                reply = await asyncio.to_thread(raw_send, port, data)
                assert message in error_message(reply)
                if message in codes:
                    assert error_frame(reply).code is codes[message]
            # The node was not hurt: the next iteration among all members is still exact.
            rng = np.random.default_rng(1)
            values = {i: rng.integers(-9, 9, nodes[1].layout.total).astype(np.float32)  # type: ignore[union-attr]
                      for i in nodes}
            results = await one_iteration(nodes, values)
            for out in results.values():
                np.testing.assert_array_equal(out, np.sum(list(values.values()), axis=0))
            assert not any(n.down for n in nodes.values())
    uvloop.run(main())


def test_a_dead_peer_fails_the_iteration_at_once_naming_peer_and_iteration():
    async def main() -> None:
        async with cluster([1, 2, 3], CONFIG.replace(iteration_timeout=30.0), rollout([1, 2, 3])) as nodes:
            for node in nodes.values():
                await node.register(SPECS)
            total = nodes[1].layout.total  # type: ignore[union-attr]
            await one_iteration(nodes, {i: np.ones(total, np.float32) for i in nodes})
            # Node 3 dies before contributing to iteration 1 (its sockets close, like a killed process),
            # and the scheduler, whose control connection to it closed too, declares it dead.
            victim = nodes.pop(3)
            victim.stop()
            loop = asyncio.get_running_loop()
            start = loop.time()
            iteration = asyncio.ensure_future(one_iteration(nodes, {i: np.ones(total, np.float32) for i in nodes}))
            await until(lambda: all(n.core.policy(1) is not None for n in nodes.values()),
                        "iteration 1 bound at every survivor")
            for node in nodes.values():
                assert isinstance(node.control, FixedControl)
                node.control.declare_down(3, "its control connection to the scheduler closed")
            with pytest.raises(PeerGone, match=r"iteration 1 .*node 3 is gone"):
                await iteration
            assert loop.time() - start < 10.0
    uvloop.run(main())


def test_a_stuck_iteration_times_out_naming_the_iteration():
    async def main() -> None:
        async with cluster([1, 2], CONFIG.replace(iteration_timeout=1.0), rollout([1, 2])) as nodes:
            for node in nodes.values():
                await node.register(SPECS)
            layout = nodes[1].layout
            assert layout is not None
            for key in range(len(layout.tensors)):  # node 2 never contributes
                await nodes[1].contribute(key, np.ones(layout.tensors[key].size, np.float32))
            with pytest.raises(IterationTimeout, match=r"iteration 0 timed out at node 1 after 1 s"):
                await nodes[1].collect(list(range(len(layout.tensors))), lambda k, v: None)
    uvloop.run(main())


def test_a_slow_receiver_keeps_the_bytes_in_the_senders_queue():
    async def main() -> None:
        # A receiver that accepts and then never reads: the kernel buffers fill, the transport pauses,
        # and the remaining frames wait in the link's queue instead of the transport's buffer.
        server = socket.create_server(("127.0.0.1", 0))
        server.setblocking(False)
        port = server.getsockname()[1]
        link = PeerLink(peer_id=2, address=("127.0.0.1", port), hello=lambda: Hello(1, ""), clock=lambda: 0.0,
                        connect_timeout=5.0)
        payload = np.zeros(1 << 20, np.float32)  # 4 MiB per frame
        header = ChunkHeader(0, 0, 2, Phase.UP, 1, 2, 1, 2, 0, 0.0, False, (1, 2), payload.size)
        for _ in range(16):
            link.enqueue(Outgoing(header, payload))
        async def sender() -> None:
            with pytest.raises(PeerError, match="connection to node 2"):
                await link.run()

        async with asyncio.TaskGroup() as tg:
            tg.create_task(sender())
            loop = asyncio.get_running_loop()
            conn, _ = await loop.sock_accept(server)
            async with asyncio.timeout(10):
                # Transports signal pausing only to their protocol: poll it, with a deadline.
                while link.protocol is None or not link.protocol._paused:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            transport = link.protocol.transport
            assert transport is not None
            assert transport.get_write_buffer_size() <= (1 << 20) + 2 * payload.nbytes
            assert link.queued_bytes >= 8 * payload.nbytes
            conn.close()  # the peer dies: the sender fails with an error naming it
        server.close()
    uvloop.run(main())


def test_auxiliary_paths_carry_chunks_exactly_once_and_hops_are_measured():
    """Aux on, a new policy every two iterations, and no barrier between iterations: a node that is done
    with iteration k starts k+1 (under the next policy) while k's chunks, some on auxiliary paths, are
    still in flight elsewhere. Every sum stays exact."""
    mesh = [1, 2, 3, 4]
    rates = {(a, b): 10.0 * (a + 2 * b) for a in mesh for b in mesh if a != b}

    def fixed(iteration: int) -> Policy:
        shifted = {(a, b): r * (1 + iteration % 3) if a == 1 else r for (a, b), r in rates.items()}
        return plan(shifted, topology="fapt", num_roots=2, version=iteration // 2)

    # Loopback runs far faster than any plan, so no link lags its plan: aux_slowdown 0 (the paper's rule)
    # offloads whenever a primary is busy. Its tiny chunks never fill a 0.25 s probe window: probe_window 0
    # reports every two samples.
    config = CONFIG.replace(enable_aux_path=True, primary_busy_bound=1, auxiliary_queue_length=3,
                            probe_chunk_size=1000, probe_chunk_num=2, chunk_size=400, aux_slowdown=0.0,
                            probe_window=0.0)
    iterations = 5
    rng = np.random.default_rng(5)
    total = sum(spec.size for spec in SPECS)
    values = [{i: rng.integers(-500, 500, total).astype(np.float32) for i in mesh} for _ in range(iterations)]

    async def main() -> None:
        async with cluster(mesh, config, fixed) as nodes:
            assert any(len(p) > 1 for p in fixed(0).aux_paths.values())
            for node in nodes.values():
                await node.register(SPECS)

            started = {(n, k): asyncio.Event() for n in mesh for k in range(iterations)}
            # The first root of iteration k+1 holds on to iteration k until every other DC has begun k+1,
            # so k+1's partial sums reach it while k is still live there.
            holder = {k: fixed(k + 1).roots[0] for k in range(iterations - 1)}

            async def trainer(node: GeneralNode) -> list[np.ndarray]:
                layout = node.layout
                assert layout is not None
                results = []
                for k in range(iterations):
                    flat = values[k][node.node_id]
                    for key in range(len(layout.tensors)):
                        await node.contribute(key, flat[layout.key_slice(key)])
                    started[(node.node_id, k)].set()
                    if holder.get(k) == node.node_id:
                        for other in mesh:
                            if other != node.node_id:
                                await started[(other, k + 1)].wait()
                    out = np.full(layout.total, np.nan, np.float32)

                    def sink(key: int, result: np.ndarray, out: np.ndarray = out) -> None:
                        out[layout.key_slice(key)] = result
                    await node.collect(list(range(len(layout.tensors))), sink)
                    results.append(out)
                return results

            per_node = await asyncio.gather(*(trainer(n) for n in nodes.values()))
            for results in per_node:
                for k, out in enumerate(results):
                    np.testing.assert_array_equal(out, np.sum(list(values[k].values()), axis=0))
            assert sum(n.forwarding.aux_chunks for n in nodes.values()) > 0
            assert all(nodes[h].core.chunks.peak_live == 2 for h in holder.values())
            reports = [r for n in nodes.values() for r in getattr(n.control, "reports", [])]
            assert reports and all(r.mbit_s > 0 and r.dst in mesh and r.src in mesh for r in reports)
    uvloop.run(main())


def test_the_receiver_reassembles_frames_split_at_any_byte():
    """Feed the BufferedProtocol a stream of frames cut at random places, as TCP may deliver it."""
    from node.peers import InboundProtocol

    rng = np.random.default_rng(11)

    def frames(counts: list[int]) -> tuple[bytes, list[ChunkHeader], list[np.ndarray]]:
        headers = [ChunkHeader(4, i, 2, Phase.UP, 1, 2, 1, 2, 0, float(i), False, (1, 2), n)
                   for i, n in enumerate(counts)]
        payloads = [rng.integers(-1000, 1000, n).astype(np.float32) for n in counts]
        stream = Hello(1, "h").encode() + b"".join(h.encode() + p.tobytes()
                                                   for h, p in zip(headers, payloads, strict=True))
        return stream, headers, payloads

    small = frames([0, 1, 3, 500, 17, 2])  # fed a few bytes at a time
    large = frames([0, 1, 3, 5000, 70000, 17, 20000])  # frames far beyond the 64 KiB staging buffer
    for trial in range(12):
        stream, headers, payloads = small if trial < 3 else large
        received: list[tuple[ChunkHeader, np.ndarray]] = []
        hellos: list[Hello] = []
        def on_hello(hello: Hello, _: InboundProtocol, hellos: list[Hello] = hellos) -> None:
            hellos.append(hello)

        def on_chunk(peer: int, header: ChunkHeader, payload: np.ndarray, t: float,
                     received: list[tuple[ChunkHeader, np.ndarray]] = received) -> None:
            received.append((header, payload.copy()))

        protocol = InboundProtocol(on_hello=on_hello, on_chunk=on_chunk, on_lost=lambda p, r: None,
                                   max_frame_bytes=1 << 24, clock=lambda: 0.0)
        position = 0
        while position < len(stream):
            buffer = protocol.get_buffer(-1)
            assert len(buffer) > 0
            step = int(rng.integers(1, 8 if trial < 3 else 200_000))
            step = min(step, len(buffer), len(stream) - position)
            buffer[:step] = stream[position:position + step]
            protocol.buffer_updated(step)
            position += step
        assert hellos == [Hello(1, "h")]
        assert [h for h, _ in received] == headers
        for (_, got), want in zip(received, payloads, strict=True):
            np.testing.assert_array_equal(got, want)


def test_a_links_backlog_is_what_waits_in_its_queue_before_it_connects():
    async def main() -> None:
        link = PeerLink(peer_id=2, address=("127.0.0.1", 9), hello=lambda: Hello(1, "h"), clock=lambda: 0.0,
                        connect_timeout=1.0)
        assert link.backlog_bytes == 0
        header = ChunkHeader(0, 3, 2, Phase.UP, 1, 2, 1, 2, 0, 0.0, False, (1, 2), 250)
        link.enqueue(Outgoing(header, np.zeros(250, np.float32)))
        link.enqueue(Outgoing(msgspec.structs.replace(header, chunk=4), np.zeros(100, np.float32)))
        assert link.backlog_bytes == 1400  # no connection yet, so nothing in a kernel buffer
    asyncio.run(main())


def test_send_queue_puts_older_iterations_then_earlier_chunks_first():
    from node.peers import SendQueue

    def item(iteration: int, phase: Phase, chunk: int) -> Outgoing:
        header = ChunkHeader(iteration, chunk, 2, phase, 1, 2, 1, 2, 0, 0.0, False, (1, 2), 1)
        return Outgoing(header, np.zeros(1, np.float32))

    queue = SendQueue()
    pushed = [(1, Phase.UP, 0), (0, Phase.UP, 1), (0, Phase.UP, 2), (1, Phase.DOWN, 3), (0, Phase.DOWN, 4),
              (0, Phase.UP, 5), (0, Phase.DOWN, 6)]
    for p in pushed:
        queue.push(item(*p))
    order = []
    while queue:
        h = queue.pop().header
        order.append((h.iteration, h.phase, h.chunk))
    assert order == [(0, Phase.UP, 1), (0, Phase.UP, 2), (0, Phase.DOWN, 4), (0, Phase.UP, 5), (0, Phase.DOWN, 6),
                     (1, Phase.UP, 0), (1, Phase.DOWN, 3)]
    queue.push(item(0, Phase.UP, 7))
    queue.push(item(0, Phase.DOWN, 7))  # the same chunk both ways (an auxiliary hop): the result first
    assert [queue.pop().header.phase for _ in range(2)] == [Phase.DOWN, Phase.UP]


def test_a_result_overtakes_partial_sums_still_waiting_on_a_busy_link():
    """Only SEND_LOWAT unsent bytes and the frame being written sit below the queue, so a DOWN frame of
    an earlier chunk, queued behind many UP frames, goes out right after the one in progress, not after
    all of them."""
    from netstorm.frames import decode_header, decode_prefix

    async def main() -> list[Phase]:
        server = socket.create_server(("127.0.0.1", 0))
        server.setblocking(False)
        port = server.getsockname()[1]
        link = PeerLink(peer_id=2, address=("127.0.0.1", port), hello=lambda: Hello(1, ""), clock=lambda: 0.0,
                        connect_timeout=5.0)
        payload = np.zeros(1 << 18, np.float32)  # 1 MiB per frame

        def frame(phase: Phase, chunk: int) -> Outgoing:
            return Outgoing(ChunkHeader(0, chunk, 2, phase, 1, 2, 1, 2, 0, 0.0, False, (1, 2), payload.size),
                            payload)

        ups = 16
        for chunk in range(ups):
            link.enqueue(frame(Phase.UP, chunk))
        phases: list[Phase] = []
        async with asyncio.TaskGroup() as tg:
            sending = tg.create_task(link.run())
            loop = asyncio.get_running_loop()
            conn, _ = await loop.sock_accept(server)
            async with asyncio.timeout(10):
                while link.protocol is None or not link.protocol._paused:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            assert link.queued_bytes >= (ups - 4) * payload.nbytes
            link.enqueue(frame(Phase.DOWN, 0))
            link.close()
            reader, writer = await asyncio.open_connection(sock=conn)
            async with asyncio.timeout(20):
                while len(phases) < ups + 1:
                    prefix = decode_prefix(await reader.readexactly(PREFIX_SIZE), max_frame_bytes=1 << 22)
                    header = decode_header(prefix, await reader.readexactly(prefix.header_len))
                    if isinstance(header, ChunkHeader):
                        await reader.readexactly(header.count * 4)
                        phases.append(header.phase)
                await sending
            writer.close()
        server.close()
        return phases

    phases = uvloop.run(main())
    assert sorted(phases) == [Phase.UP] * 16 + [Phase.DOWN]
    # the DOWN frame left after at most the UP frames already below the queue (kernel and transport)
    assert phases.index(Phase.DOWN) <= 3


@pytest.mark.parametrize("reroute", [1.0, 0.0])
def test_chunks_queued_on_a_lagging_edge_move_to_idle_links_exactly_once(reroute: float) -> None:
    """Every node sees its links crawl at 1 byte/s against the plan (loopback is too fast to lag
    anything), so with ``aux_reroute`` on, chunks queued on a busy tree edge move to idle links'
    auxiliary paths (none is offloaded when queued: the busy bound is out of reach). Sums stay exact;
    with ``aux_reroute`` 0 nothing moves."""
    mesh = [1, 2, 3, 4]
    rates = {(a, b): 10.0 * (a + 2 * b) for a in mesh for b in mesh if a != b}
    policy = plan(rates, topology="fapt", num_roots=2, version=0)
    config = CONFIG.replace(enable_aux_path=True, primary_busy_bound=10_000, auxiliary_queue_length=2,
                            chunk_size=400, aux_slowdown=0.3, aux_reroute=reroute)
    iterations = 3
    rng = np.random.default_rng(11)
    total = sum(spec.size for spec in SPECS)
    values = [{i: rng.integers(-500, 500, total).astype(np.float32) for i in mesh} for _ in range(iterations)]

    async def main() -> None:
        async with cluster(mesh, config, lambda _: policy) as nodes:
            assert any(len(p) > 1 for p in policy.aux_paths.values())
            for node in nodes.values():
                await node.register(SPECS)

                def crawling(peer: int, node: GeneralNode = node) -> LinkView:
                    return LinkView(node.links[peer].backlog_bytes, 1.0)
                node._link_view = crawling  # type: ignore[method-assign]
            for k in range(iterations):
                results = await one_iteration(nodes, values[k])
                for out in results.values():
                    np.testing.assert_array_equal(out, np.sum(list(values[k].values()), axis=0))
            moved = sum(n.forwarding.moved_chunks for n in nodes.values())
            assert sum(n.forwarding.aux_chunks for n in nodes.values()) == 0
            assert (moved > 0) == (reroute > 0), moved
            for node in nodes.values():  # every moved chunk left: no path still counts one in flight
                for scheduler in node.forwarding._schedulers.values():
                    assert all(count == 0 for count in scheduler.in_flight.values()), scheduler.in_flight
    uvloop.run(main())


def _mesh_with_detours(fraction: float) -> tuple[dict[tuple[int, int], float], Policy, dict]:
    """A 4-DC mesh's rates, its two-root plan, and a move of ``fraction`` of every tree link's chunks
    onto its first detour."""
    rates = {(a, b): 10.0 * (a + 2 * b) for a in MESH for b in MESH if a != b}
    base = plan(rates, topology="fapt", num_roots=2)
    moves = {link: ((paths[1], fraction),) for link, paths in base.aux_paths.items()
             if link in base.tree_links() and len(paths) > 1}
    assert moves
    return rates, base, moves


def test_planned_offload_sends_its_fraction_over_detours_and_sums_stay_exact():
    """Every tree link sends half its chunks over a detour in even iterations' policy, none in odd ones'
    (policy changes with detoured chunks in flight); only the plan moves chunks (no link lags on
    loopback). Every sum is exact, and the detours carried chunks."""
    mesh = MESH
    _, base, offload = _mesh_with_detours(0.5)

    def fixed(iteration: int) -> Policy:
        return dataclasses.replace(base, version=iteration, offload=offload if iteration % 2 == 0 else {})

    config = CONFIG.replace(enable_aux_path=True)
    rng = np.random.default_rng(11)
    total = sum(spec.size for spec in SPECS)

    async def main() -> None:
        async with cluster(mesh, config, fixed) as nodes:
            for node in nodes.values():
                await node.register(SPECS)
            for _ in range(4):
                values = {i: rng.integers(-500, 500, total).astype(np.float32) for i in mesh}
                results = await one_iteration(nodes, values)
                for out in results.values():
                    np.testing.assert_array_equal(out, np.sum(list(values.values()), axis=0))
            assert sum(n.forwarding.aux_chunks for n in nodes.values()) > 0
            assert sum(n.forwarding.moved_chunks for n in nodes.values()) == 0
    uvloop.run(main())


def test_moves_replanned_mid_iteration_move_queued_chunks_and_sums_stay_exact():
    """A newer policy's beliefs re-plan the moves of the iteration running on an older one: right after
    each node queued its contributions, every tree link's chunks are re-planned onto a detour (all of
    them). The queued chunks leave over the detours, chunks chosen later follow the new moves too, the
    next iteration (its own policy, no amendment) runs as planned, and every sum is exact."""
    mesh = MESH
    rates, base, moves = _mesh_with_detours(1.0)
    config = CONFIG.replace(enable_aux_path=True)
    rng = np.random.default_rng(5)
    total = sum(spec.size for spec in SPECS)

    def amend(node: GeneralNode) -> None:
        assert isinstance(node.control, FixedControl)
        movable = sum(link.count(lambda o: o.ticket is not None and node.core.movable(o.ticket)
                                 and (node.node_id, o.header.dst) in moves)
                      for link in node.links.values())
        before = node.forwarding.moved_chunks
        node.control.push_beliefs(LinkBeliefs(version=1, rates=rates, amends=0, offload=moves))
        assert node.forwarding.moved_chunks - before == movable

    async def iteration(nodes: dict[int, GeneralNode], pushed: Callable[[GeneralNode], None] | None) -> None:
        values = {i: rng.integers(-500, 500, total).astype(np.float32) for i in mesh}
        for out in (await one_iteration(nodes, values, pushed)).values():
            np.testing.assert_array_equal(out, np.sum(list(values.values()), axis=0))

    async def main() -> None:
        async with cluster(mesh, config, lambda k: dataclasses.replace(base, version=k)) as nodes:
            for node in nodes.values():
                await node.register(SPECS)
            await iteration(nodes, amend)
            moved = sum(n.forwarding.moved_chunks for n in nodes.values())
            assert moved > 0
            await iteration(nodes, None)
            assert sum(n.forwarding.moved_chunks for n in nodes.values()) == moved, "iteration 1 kept its plan"
            for node in nodes.values():  # every moved chunk left: no path still counts one in flight
                for scheduler in node.forwarding._schedulers.values():
                    assert all(count == 0 for count in scheduler.in_flight.values()), scheduler.in_flight
    uvloop.run(main())
