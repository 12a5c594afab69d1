"""The data plane against an attacker with raw sockets and against lost links, in-process on loopback.

Only the scheduler declares a member dead: a fake Hello followed by a close, or a link that breaks,
marks nobody gone at a node (the link reconnects and reports to the control plane). Nothing is
allocated or buffered for chunks the node cannot check (before its layout exists, or with sizes and
iterations no correct peer sends), and connections that never say who they are, stall mid-frame or
come in crowds from one address are closed. Memory is measured with tracemalloc against a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import tracemalloc
from collections.abc import Iterator

import numpy as np
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from netstorm.config import Config
from netstorm.errors import ErrorCode
from netstorm.frames import ChunkHeader, Hello, Phase
from netstorm.layout import Layout
from node.core import NodeCore
from node.peers import InboundProtocol
from node.service import GeneralNode
from tests.dataplane import FixedControl, cluster, until
from tests.test_peers import SPECS, error_frame, one_iteration, raw_send, rollout

CONFIG = Config(chunk_size=500, iteration_timeout=30.0, connect_timeout=5.0)
MB = 1 << 20


def port_of(node: GeneralNode) -> int:
    assert node._server is not None
    return int(node._server.sockets[0].getsockname()[1])


def control_of(node: GeneralNode) -> FixedControl:
    assert isinstance(node.control, FixedControl)
    return node.control


@contextlib.contextmanager
def traced() -> Iterator[list[int]]:
    """Bytes allocated past the start, at the end and at the peak: ``[current, peak]``."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    out = [0, 0]
    try:
        yield out
    finally:
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out[:] = [current - base, peak - base]


def exact(results: dict[int, np.ndarray], values: dict[int, np.ndarray]) -> None:
    for out in results.values():
        np.testing.assert_array_equal(out, np.sum(list(values.values()), axis=0))


def values_for(nodes: dict[int, GeneralNode], seed: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    total = nodes[1].layout.total  # type: ignore[union-attr]
    return {i: rng.integers(-9, 9, total).astype(np.float32) for i in nodes}


def test_a_fake_hello_and_a_close_mark_no_member_gone() -> None:
    async def main() -> None:
        async with cluster([1, 2, 3, 4], CONFIG, rollout([1, 2, 3, 4])) as nodes:
            for node in nodes.values():
                await node.register(SPECS)
            victim = nodes[4]
            # Before node 1 ever connected to node 4: a stranger says it is node 1, then hangs up.
            with socket.create_connection(("127.0.0.1", port_of(victim)), timeout=5) as s:
                s.sendall(Hello(1, victim.layout.hash).encode())  # type: ignore[union-attr]
                await until(lambda: 1 in victim._inbound_by_peer, "the fake Hello")
            await until(lambda: 1 not in victim._inbound_by_peer, "the close")
            assert victim.down == {}
            values = values_for(nodes, 1)
            exact(await one_iteration(nodes, values), values)  # not at the iteration timeout: at once
            assert not any(n.down for n in nodes.values())
    uvloop.run(main())


def test_a_lost_link_reconnects_reports_and_the_iteration_completes() -> None:
    async def main() -> None:
        async with cluster([1, 2, 3], CONFIG, rollout([1, 2, 3])) as nodes:
            for node in nodes.values():
                await node.register(SPECS)
            values = values_for(nodes, 2)
            exact(await one_iteration(nodes, values), values)
            link = nodes[1].links[2]
            assert link.protocol is not None and link.protocol.transport is not None
            link.protocol.transport.abort()  # the connection breaks between iterations
            await until(lambda: link.protocol is None or link.protocol.closed.done(), "the break")
            values = values_for(nodes, 3)
            exact(await one_iteration(nodes, values), values)
            assert not any(n.down for n in nodes.values())
            assert [peer for peer, _ in control_of(nodes[1]).unreachable] == [2]
    uvloop.run(main())


def test_chunks_sent_before_the_layout_exists_are_not_buffered() -> None:
    async def main() -> None:
        async with cluster([1, 2], CONFIG, rollout([1, 2])) as nodes:
            # Node 2's trainer has not registered: a member sends it megabytes of chunks anyway.
            header = ChunkHeader(0, 0, 1, Phase.UP, 1, 2, 1, 2, 0, 0.0, False, (1, 2), 256 * 1024)
            frame = header.encode() + bytes(header.count * 4)
            sent = 0

            def flood() -> None:
                nonlocal sent
                with socket.create_connection(("127.0.0.1", port_of(nodes[2])), timeout=5) as s:
                    s.sendall(Hello(1, "").encode())
                    s.settimeout(2.0)
                    with contextlib.suppress(TimeoutError, OSError):
                        for _ in range(100):  # 100 MB offered
                            s.sendall(frame)
                            sent += len(frame)

            with traced() as grown:
                await asyncio.to_thread(flood)
            assert sent < 100 * len(frame)  # the node stopped reading: the sender blocked
            assert grown[1] < 8 * MB, grown
            assert nodes[2].core.chunks._early == {}
    uvloop.run(main())


def test_a_peer_that_pushes_before_this_node_has_a_layout_waits_and_the_sum_is_exact() -> None:
    async def main() -> None:
        async with cluster([1, 2], CONFIG, rollout([1, 2])) as nodes:
            await nodes[1].register(SPECS)
            layout = nodes[1].layout
            assert layout is not None
            values = values_for(nodes, 6)
            for key in range(len(layout.tensors)):
                await nodes[1].contribute(key, values[1][layout.key_slice(key)])
            # Node 1's chunks reach node 2 before its trainer registered: its connection stops reading.
            await until(lambda: any(p._held is not None for p in nodes[2]._inbound), "a chunk held back")
            await nodes[2].register(SPECS)
            for key in range(len(layout.tensors)):
                await nodes[2].contribute(key, values[2][layout.key_slice(key)])
            for node in nodes.values():
                out = np.full(layout.total, np.nan, np.float32)

                def sink(key: int, result: np.ndarray, out: np.ndarray = out) -> None:
                    out[layout.key_slice(key)] = result
                await node.collect(list(range(len(layout.tensors))), sink)
                np.testing.assert_array_equal(out, values[1] + values[2])
    uvloop.run(main())


def test_a_hostile_chunk_header_is_refused_before_its_payload_is_allocated() -> None:
    async def main() -> None:
        async with cluster([1, 2], CONFIG, rollout([1, 2])) as nodes:
            for node in nodes.values():
                await node.register(SPECS)
            layout_hash = nodes[2].layout.hash  # type: ignore[union-attr]
            big = ChunkHeader(0, 0, 1, Phase.UP, 1, 2, 1, 2, 0, 0.0, False, (1, 2), 15 * MB)  # 60 MB < max frame
            far = ChunkHeader(10**9, 0, 1, Phase.UP, 1, 2, 1, 2, 0, 0.0, False, (1, 2), 7)
            for header, why in ((big, "layout says"), (far, "far ahead")):
                with traced() as grown:
                    reply = await asyncio.to_thread(raw_send, port_of(nodes[2]), Hello(1, layout_hash).encode()
                                                    + header.encode() + bytes(64))
                assert why in error_frame(reply).message
                assert grown[1] < 4 * MB, (why, grown)
            values = values_for(nodes, 4)
            exact(await one_iteration(nodes, values), values)
    uvloop.run(main())


def test_silent_stalled_and_crowding_connections_are_closed() -> None:
    config = CONFIG.replace(hello_timeout=0.5, frame_timeout=0.5, max_connections_per_source=8)

    async def main() -> None:
        async with cluster([1, 2], config, rollout([1, 2])) as nodes:
            for node in nodes.values():
                await node.register(SPECS)
            port = port_of(nodes[2])
            layout_hash = nodes[2].layout.hash  # type: ignore[union-attr]

            def answer(s: socket.socket) -> bytes:
                s.settimeout(10)
                data = b""
                while part := s.recv(4096):
                    data += part
                return data

            def silent() -> bytes:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    return answer(s)

            def half_sent() -> bytes:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    header = ChunkHeader(0, 0, 1, Phase.UP, 1, 2, 1, 2, 0, 0.0, False, (1, 2), 7)
                    s.sendall(Hello(1, layout_hash).encode() + header.encode() + bytes(10))
                    return answer(s)

            for reply, why in ((await asyncio.to_thread(silent), "no Hello within"),
                               (await asyncio.to_thread(half_sent), "stalled mid-frame")):
                assert why in error_frame(reply).message
                assert error_frame(reply).code is ErrorCode.TIMEOUT
            crowd = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(12)]
            try:
                replies = await asyncio.gather(*(asyncio.to_thread(answer, s) for s in crowd[8:]))
                assert all("more than 8 connections" in error_frame(r).message for r in replies)
            finally:
                for s in crowd:
                    s.close()
            await until(lambda: len(nodes[2]._inbound) <= 2, "the crowd gone")
            values = values_for(nodes, 5)
            exact(await one_iteration(nodes, values), values)
    uvloop.run(main())



class _Transport:
    """Enough of a transport for the receiver: what it writes, whether it closed or paused."""

    def __init__(self) -> None:
        self.written = b""
        self.closed = False
        self.paused = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_extra_info(self, name: str) -> object:
        return ("127.0.0.1", 9) if name == "peername" else None


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(iteration=st.integers(min_value=0, max_value=2**40), chunk=st.integers(min_value=0, max_value=2**20),
       count=st.integers(min_value=0, max_value=2**24), tail=st.binary(max_size=200),
       step=st.integers(min_value=1, max_value=4096))
def test_the_receiver_allocates_only_for_chunks_the_layout_admits(iteration: int, chunk: int, count: int,
                                                                   tail: bytes, step: int) -> None:
    core = NodeCore(2, CONFIG)
    core.join(CONFIG, [1, 2], {})
    core.register(Layout.build(SPECS, CONFIG.chunk_size), {}, 0.0)
    layout = core.layout
    assert layout is not None
    largest = max(c.count for c in layout.chunks)
    delivered: list[ChunkHeader] = []
    protocol = InboundProtocol(on_hello=lambda h, p: None, on_chunk=lambda p, h, a, t: delivered.append(h),
                               on_lost=lambda p, r: None, max_frame_bytes=CONFIG.max_frame_bytes,
                               clock=lambda: 0.0, on_admit=core.admit)
    transport = _Transport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    header = ChunkHeader(iteration, chunk, 1, Phase.UP, 1, 2, 1, 2, 0, 0.0, False, (1, 2), count)
    stream = Hello(1, layout.hash).encode() + header.encode() + tail
    position = 0
    while position < len(stream) and not transport.closed:
        buffer = protocol.get_buffer(-1)
        size = min(step, len(buffer), len(stream) - position)
        buffer[:size] = stream[position:position + size]
        protocol.buffer_updated(size)
        position += size
        payload = protocol._payload
        assert payload is None or payload.size <= largest  # nothing beyond what the layout admits
    # a chunk may carry fewer elements than the layout's (the all-zero tail is elided), never more
    admitted = chunk < len(layout.chunks) and count <= layout.chunks[chunk].count \
        and iteration <= core.chunks.horizon + 1
    if not admitted:
        assert transport.closed and b"NSF1" in transport.written and delivered == []
    assert all(h.count <= layout.chunks[h.chunk].count for h in delivered)
