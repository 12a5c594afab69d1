"""Every connection has a deadline in every state: a fake client on loopback opens each TCP plane
(scheduler control, admin, node <-> node, trainer TCP and the trainer's Unix socket), gets as far as a
state (connected, authenticated, said Hello or registered, mid-frame, after a request) and goes
silent. Each is closed within its configured bound (waited on with a deadline, never a sleep), with
a word saying why where the plane has one; a live link past its idle bound stays open (keepalives)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from collections.abc import Awaitable
from pathlib import Path

import numpy as np
import uvloop

from netstorm import auth, authconn, control
from netstorm import trainer_wire as tw
from netstorm.errors import ErrorCode
from netstorm.frames import Hello
from node.trainer_endpoint import TrainerEndpoint
from tests.dataplane import cluster, until
from tests.test_auth_planes import ADMIN
from tests.test_auth_planes import scheduler as secret_scheduler
from tests.test_peers import CONFIG, SPECS, error_frame, one_iteration, rollout
from tests.test_scheduler_service import FAST, addr
from tests.test_scheduler_service import scheduler as open_scheduler

BOUND = 0.4
"""Each deadline under test, in seconds."""
SLACK = 3.0
"""How much later than its bound a close may come before the test fails (a loaded host's scheduling)."""
CONTROL = dataclasses.replace(FAST, connect_timeout=BOUND, idle_timeout=BOUND)


async def closed_within(what: str, bound: float, ended: Awaitable[bytes]) -> tuple[bytes, float]:
    """What the other side said before closing, and after how long; fails when it did not close in time."""
    start = time.perf_counter()
    try:
        said = await asyncio.wait_for(ended, bound + SLACK)
    except TimeoutError:
        raise AssertionError(f"{what}: still open {bound + SLACK:g} s after going silent") from None
    return said, time.perf_counter() - start


async def until_closed(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    try:
        while part := await reader.read(65536):
            out += part
    except ConnectionError:
        pass
    return bytes(out)


def control_error(data: bytes) -> control.Error:
    (length,) = control.LENGTH.unpack_from(data)
    message = control.decode(data[control.LENGTH.size:control.LENGTH.size + length])
    assert isinstance(message, control.Error)
    return message


# --- scheduler: control and admin ----------------------------------------------------------------------


def test_every_control_connection_state_has_a_deadline() -> None:
    async def main() -> None:
        async with secret_scheduler(config=CONTROL) as service:
            where = addr(service)
            # Connected, never authenticates: the handshake's deadline.
            reader, writer = await asyncio.open_connection(*where)
            await closed_within("silent before the handshake", BOUND, until_closed(reader))
            writer.close()
            # Authenticated as node 1, never registers.
            reader, writer = await authconn.open_stream(*where, ADMIN, plane=auth.Plane.CONTROL, me=auth.node(1),
                                                        timeout=5)
            said, _ = await closed_within("authenticated, silent", BOUND, until_closed(reader))
            assert control_error(said).code is ErrorCode.TIMEOUT
            writer.close()
            # Registered as node 1 (the job waits for the other three), then silent: no heartbeat.
            reader, writer = await authconn.open_stream(*where, ADMIN, plane=auth.Plane.CONTROL, me=auth.node(1),
                                                        timeout=5)
            writer.write(control.encode(control.Register(1, "127.0.0.1", 40001)))
            said, _ = await closed_within("registered, silent", BOUND, until_closed(reader))
            assert control_error(said).code is ErrorCode.TIMEOUT and "nothing received" in control_error(said).message
            writer.close()
            assert 1 not in service.membership.alive
            # An admin tool after its answer.
            reader, writer = await authconn.open_stream(*where, ADMIN, plane=auth.Plane.CONTROL, me=auth.ADMIN,
                                                        timeout=5)
            writer.write(control.encode(control.StatusRequest()))
            assert isinstance(await asyncio.wait_for(control.read_message(reader), 5), control.Status)
            said, _ = await closed_within("admin after its answer", BOUND, until_closed(reader))
            assert control_error(said).code is ErrorCode.TIMEOUT
            writer.close()
            # Mid-frame: a length prefix and half a body.
            reader, writer = await authconn.open_stream(*where, ADMIN, plane=auth.Plane.CONTROL, me=auth.ADMIN,
                                                        timeout=5)
            writer.write(control.encode(control.StatusRequest())[:-1])
            await closed_within("mid-frame", BOUND, until_closed(reader))
            writer.close()
    uvloop.run(main())


def test_a_registered_node_that_goes_silent_without_a_secret_is_closed_too() -> None:
    async def main() -> None:
        async with open_scheduler(CONTROL) as service:
            reader, writer = await asyncio.open_connection(*addr(service))
            writer.write(control.encode(control.Register(2, "127.0.0.1", 40002)))
            said, _ = await closed_within("registered, silent", BOUND, until_closed(reader))
            assert control_error(said).code is ErrorCode.TIMEOUT
            writer.close()
    uvloop.run(main())


# --- node <-> node -------------------------------------------------------------------------------------


PEER_IDLE = 1.5
"""The data plane's idle bound: longer than BOUND, since a live link must survive a loaded host's stalls
between its keepalives (every PEER_IDLE / 3)."""
PEERS = dataclasses.replace(CONFIG, hello_timeout=BOUND, frame_timeout=BOUND, idle_timeout=PEER_IDLE,
                            heartbeat_interval=0.1)


def _peer_exchange(port: int, data: bytes) -> bytes:
    """Connect to a node's data port, send ``data``, then stay silent until it closes; what it said."""
    with socket.create_connection(("127.0.0.1", port), timeout=PEER_IDLE + SLACK) as sock:
        sock.sendall(data)
        out = []
        while part := sock.recv(65536):
            out.append(part)
        return b"".join(out)


def test_every_data_connection_state_has_a_deadline_and_live_links_stay_open() -> None:
    async def main() -> None:
        async with cluster([1, 2, 3], PEERS, rollout([1, 2, 3])) as nodes:
            for node in nodes.values():
                await node.register(SPECS)
            layout = nodes[2].layout
            assert layout is not None
            port = nodes[2]._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            hello = Hello(1, layout.hash).encode()
            for what, data, why, bound in (("connected, no Hello", b"", "no Hello within", BOUND),
                                           ("after its Hello", hello, "silent for", PEER_IDLE),
                                           ("mid-frame", hello + hello[:7], "stalled mid-frame", BOUND)):
                said, _ = await closed_within(what, bound, asyncio.to_thread(_peer_exchange, port, data))
                refusal = error_frame(said)
                assert refusal.code is ErrorCode.TIMEOUT and why in refusal.message, (what, refusal.message)
            values = {i: np.full(layout.total, float(i), dtype=np.float32) for i in nodes}
            for out in (await one_iteration(nodes, values)).values():
                np.testing.assert_array_equal(out, np.full_like(out, 6.0))
            # Idle links outlive their receivers' idle bound: each sender says Hello again meanwhile.
            inbound = {n: dict(node._inbound_by_peer) for n, node in nodes.items()}
            frames = {(n, p): protocol.frames for n, peers in inbound.items() for p, protocol in peers.items()}
            assert frames

            # Four keepalives each: the links stayed silent past their receivers' bound (4/3 of it).
            await until(lambda: all(inbound[n][p].frames >= count + 4 for (n, p), count in frames.items()),
                        "four keepalives on every link", 4 * PEER_IDLE / 3 + SLACK)
            assert {n: dict(node._inbound_by_peer) for n, node in nodes.items()} == inbound
            for out in (await one_iteration(nodes, values)).values():
                np.testing.assert_array_equal(out, np.full_like(out, 6.0))
            assert not any(node.down for node in nodes.values())
    uvloop.run(main())


# --- trainers ------------------------------------------------------------------------------------------


TRAINERS = dataclasses.replace(CONFIG, trainer_idle_timeout=BOUND)
INIT = tw.InitRequest(tensors=(("w", (6,), "float32"),), shm="")


async def _reply(reader: asyncio.StreamReader) -> tw.Message:
    header_len, payload_len = tw.decode_prefix(await reader.readexactly(tw.PREFIX.size), max_payload=1 << 20)
    reply = tw.decode(await reader.readexactly(header_len))
    await reader.readexactly(payload_len)
    return reply


def _timed_out(said: bytes) -> None:
    header_len, _ = tw.decode_prefix(said[:tw.PREFIX.size], max_payload=0)
    reply = tw.decode(said[tw.PREFIX.size:tw.PREFIX.size + header_len])
    assert isinstance(reply, tw.ErrorReply) and reply.kind is ErrorCode.TIMEOUT, reply
    assert "trainer_idle_timeout" in reply.message


def test_a_silent_trainer_connection_is_closed_on_tcp_and_unix(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster([1, 2], TRAINERS, rollout([1, 2]), credentials=ADMIN) as nodes:
            endpoints = {n: TrainerEndpoint(node, credentials=ADMIN) for n, node in nodes.items()}
            try:
                ports = {n: (await e.serve_tcp("127.0.0.1", 0)).sockets[0].getsockname()[1]
                         for n, e in endpoints.items()}
                path = tmp_path / "node-1.sock"
                await endpoints[1].serve_unix(path)
                # Connected (authenticated over TCP), never a request.
                tcp = await authconn.open_stream("127.0.0.1", ports[1], ADMIN, plane=auth.Plane.TRAINER,
                                                 me=auth.TRAINER, timeout=5)
                unix = await asyncio.open_unix_connection(str(path))
                for (reader, writer), kind in ((tcp, "tcp"), (unix, "unix")):
                    said, _ = await closed_within(f"{kind} trainer, no request", BOUND, until_closed(reader))
                    _timed_out(said)
                    writer.close()
                # After init (both DCs' trainers, so the init round completes), then silent.
                streams = [await authconn.open_stream("127.0.0.1", ports[n], ADMIN, plane=auth.Plane.TRAINER,
                                                      me=auth.TRAINER, timeout=5) for n in (1, 2)]
                values = np.arange(6, dtype="<f4")
                for _, writer in streams:
                    writer.write(tw.encode(INIT, values.nbytes) + values.tobytes())
                replies = await asyncio.wait_for(asyncio.gather(*(_reply(r) for r, _ in streams)), 10)
                assert all(isinstance(r, tw.InitReply) for r in replies), replies
                for n, (reader, writer) in zip((1, 2), streams, strict=True):
                    said, _ = await closed_within(f"trainer of node {n} after init", BOUND, until_closed(reader))
                    _timed_out(said)
                    writer.close()
            finally:
                for endpoint in endpoints.values():
                    endpoint.close()
    uvloop.run(main())
