"""Every TCP plane with a job secret, attacked the way a stranger on the network would: raw sockets that
speak each plane's protocol without the secret, a wrong secret, a replayed handshake, a proven member
claiming another member's id. Each attack is refused with the authentication error, and the job it
aimed at goes on exactly as if it had not happened."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import stat
import struct
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import uvloop

import netstorm
from netstorm import auth, authconn, control
from netstorm.authconn import Credentials
from netstorm.cli import main as cli_main
from netstorm.config import Config
from netstorm.control import ControlAuthError
from netstorm.errors import AuthError, ConfigError, ErrorCode, TrainerAuthError
from netstorm.frames import ChunkHeader, Hello, Phase
from netstorm.layout import TensorSpec
from node.control_client import SchedulerClient
from node.peers import OutboundProtocol
from node.trainer_endpoint import TrainerEndpoint
from scheduler import admin
from scheduler.service import SchedulerService
from tests.dataplane import cluster
from tests.test_peers import CONFIG, SPECS, error_frame, one_iteration, raw_send, rollout
from tests.test_scheduler_service import FAST, RATES, T, addr
from tests.test_scheduler_service import scheduler as shared_scheduler

SECRET = bytes(range(48))
WRONG = bytes(range(1, 49))
ADMIN = Credentials(SECRET)


def secret_file(tmp_path: Path, data: bytes = SECRET, name: str = "job.secret") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    path.chmod(0o600)
    return path


@contextlib.asynccontextmanager
async def scheduler(credentials: Credentials | None = ADMIN, nodes: Sequence[int] = (1, 2, 3, 4),
                    config: Config = FAST) -> AsyncIterator[SchedulerService]:
    """The scheduler of the scheduler-service tests, holding the job secret by default."""
    async with shared_scheduler(config, nodes, credentials=credentials) as service:
        yield service


address = addr


def exchange(where: tuple[str, int], data: bytes) -> bytes:
    """Send bytes on a fresh socket, half-close, and return everything the other side says before it closes."""
    with socket.create_connection(where, timeout=T) as sock:
        sock.sendall(data)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while part := sock.recv(65536):
            chunks.append(part)
        return b"".join(chunks)


def control_reply(data: bytes) -> control.Message:
    (length,) = control.LENGTH.unpack_from(data)
    return control.decode(data[control.LENGTH.size:control.LENGTH.size + length])


async def register(service: SchedulerService, node_id: int, credentials: Credentials | None = ADMIN
                   ) -> SchedulerClient:
    return await SchedulerClient.connect(address(service), node_id, ("127.0.0.1", 40000 + node_id), timeout=T,
                                         credentials=credentials)


# --- node <-> scheduler ------------------------------------------------------------------------------


def test_an_impostor_registering_as_node_3_first_is_refused_and_the_real_node_3_joins() -> None:
    async def main() -> None:
        async with scheduler() as service:
            # Without the secret: speaking the control protocol straight away.
            reply = await asyncio.to_thread(exchange, address(service),
                                            control.encode(control.Register(3, "10.6.6.6", 4444)))
            refusal = control_reply(reply)
            assert isinstance(refusal, control.Error) and refusal.code is ErrorCode.AUTH
            assert "authentication failed: wrong or missing secret" in refusal.message
            # With a wrong secret, through the handshake.
            with pytest.raises(ControlAuthError, match="wrong or missing secret"):
                await register(service, 3, Credentials(WRONG))
            assert service.membership.registered == ()
            clients = await asyncio.gather(*(register(service, n) for n in (3, 1, 2, 4)))
            try:
                assert service.membership.members()[3] == ("127.0.0.1", 40003)
                assert service.complete.is_set()
            finally:
                for client in clients:
                    await client.close()
    uvloop.run(main())


def test_a_member_proven_as_one_node_cannot_register_as_another() -> None:
    async def main() -> None:
        async with scheduler() as service:
            reader, writer = await authconn.open_stream(*address(service), ADMIN, plane=auth.Plane.CONTROL,
                                                        me=auth.node(1), timeout=T)
            try:
                writer.write(control.encode(control.Register(3, "127.0.0.1", 40003)))
                reply = await asyncio.wait_for(control.read_message(reader), T)
            finally:
                writer.close()
            assert isinstance(reply, control.Error) and reply.code is ErrorCode.AUTH
            assert "authenticated as node 3; this one is node 1" in reply.message
            assert service.membership.registered == ()
    uvloop.run(main())


def test_a_replayed_handshake_transcript_is_refused() -> None:
    """A recording of node 3's handshake, replayed on a new connection, proves nothing: the scheduler's
    nonce is new."""
    async def main() -> None:
        async with scheduler() as service:
            def record_and_replay() -> bytes:
                handshake = auth.Handshake(SECRET, auth.Plane.CONTROL, auth.node(3), client=True, now=0.0,
                                           timeout=T)
                sent = []
                with socket.create_connection(address(service), timeout=T) as sock:
                    sent.append(handshake.data_to_send())
                    sock.sendall(sent[-1])
                    while not handshake.done:
                        handshake.receive(sock.recv(handshake.wanted()))
                        out = handshake.data_to_send()
                        if out:
                            sent.append(out)
                            sock.sendall(out)
                return exchange(address(service), b"".join(sent))
            reply = await asyncio.to_thread(record_and_replay)
            messages = []
            while reply:
                _, length = auth.HEADER.unpack_from(reply)
                messages.append(auth.decode(reply[auth.HEADER.size:auth.HEADER.size + length]))
                reply = reply[auth.HEADER.size + length:]
            assert [m.TYPE for m in messages] == ["answer", "refusal"]
            assert isinstance(messages[-1], auth.Refusal)
            assert messages[-1].message == "authentication failed: wrong or missing secret"
            assert service.membership.registered == ()
    uvloop.run(main())


def test_a_secret_on_one_side_only_gives_a_clear_authentication_error() -> None:
    async def main() -> None:
        async with scheduler(credentials=None) as service:
            with pytest.raises(ControlAuthError, match="answered without authenticating"):
                await register(service, 1)
            assert service.membership.registered == ()
        async with scheduler() as service:
            with pytest.raises(ControlAuthError, match="refused node 1: authentication failed: wrong or missing"):
                await register(service, 1, credentials=None)
            assert service.membership.registered == ()
    uvloop.run(main())


# --- admin ---------------------------------------------------------------------------------------


def test_a_policy_override_from_an_unauthenticated_socket_is_refused() -> None:
    async def main() -> None:
        async with scheduler() as service:
            clients = await asyncio.gather(*(register(service, n) for n in (1, 2, 3, 4)))
            try:
                version = service.consistency.current_version
                forged = control.PolicyOverride({(1, 2): 1.0, (2, 1): 1.0, (1, 3): 1.0})
                reply = control_reply(await asyncio.to_thread(exchange, address(service), control.encode(forged)))
                assert isinstance(reply, control.Error) and reply.code is ErrorCode.AUTH
                with pytest.raises(ControlAuthError, match="wrong or missing secret"):
                    await admin.override_policy(address(service), RATES, timeout=T)
                with pytest.raises(ControlAuthError, match="wrong or missing secret"):
                    await admin.override_policy(address(service), RATES, timeout=T, credentials=Credentials(WRONG))
                # A member is no admin: node 1's proven connection may not change the policy either.
                reader, writer = await authconn.open_stream(*address(service), ADMIN, plane=auth.Plane.CONTROL,
                                                            me=auth.node(1), timeout=T)
                try:
                    writer.write(control.encode(forged))
                    refused = await asyncio.wait_for(control.read_message(reader), T)
                finally:
                    writer.close()
                assert isinstance(refused, control.Error) and refused.code is ErrorCode.AUTH
                assert "authenticated as admin" in refused.message
                assert service.consistency.current_version == version
                assert await admin.override_policy(address(service), RATES, timeout=T, credentials=ADMIN) \
                    > (version or 0)
            finally:
                for client in clients:
                    await client.close()
    uvloop.run(main())


def test_status_needs_the_secret_and_shows_members_before_any_registered(tmp_path: Path) -> None:
    good, wrong = secret_file(tmp_path), secret_file(tmp_path, WRONG, "wrong.secret")

    async def cli(*argv: str) -> tuple[int, str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("NETSTORM_")}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "netstorm.cli", "status", *argv, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env={**env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
        async with asyncio.timeout(60):
            out, err = await process.communicate()
        assert process.returncode is not None
        return process.returncode, out.decode(), err.decode()

    async def main() -> None:
        async with scheduler() as service:
            where = control.format_address(address(service))
            with pytest.raises(ControlAuthError, match="wrong or missing secret"):
                await admin.status(address(service), timeout=T)
            with pytest.raises(ControlAuthError, match="wrong or missing secret"):
                await admin.status(address(service), timeout=T, credentials=Credentials(WRONG))
            status = await admin.status(address(service), timeout=T, credentials=ADMIN)
            assert [state for _, state, _ in status.states] == ["expected"] * 4 and status.version == -1

            code, out, err = await cli("--scheduler", where)
            assert code != 0 and "authentication failed: wrong or missing secret" in err, (out, err)
            code, out, err = await cli("--scheduler", where, "--secret-file", str(wrong))
            assert code != 0 and "authentication failed: wrong or missing secret" in err, (out, err)
            code, out, err = await cli("--scheduler", where, "--secret-file", str(good), "--json")
            assert code == 0, err
            assert '"state": "expected"' in out and '"policy_version": -1' in out

            clients = await asyncio.gather(*(register(service, n) for n in (1, 2, 3, 4)))
            try:
                await clients[0].policy_for(0, timeout=T)
                code, out, err = await cli("--scheduler", where, "--secret-file", str(good))
                assert code == 0, err
                assert "127.0.0.1:40003" in out and "alive" in out and "last bound iteration 0" in out, out
            finally:
                for client in clients:
                    await client.close()
    uvloop.run(main())


# --- node <-> node -----------------------------------------------------------------------------------


def test_a_fake_hello_as_node_1_at_node_4_then_a_close_changes_nothing() -> None:
    async def main() -> None:
        async with cluster([1, 2, 3, 4], CONFIG, rollout([1, 2, 3, 4]), credentials=ADMIN) as nodes:
            for node in nodes.values():
                await node.register(SPECS)
            layout_hash = nodes[4].layout.hash  # type: ignore[union-attr]
            port = nodes[4]._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            reply = await asyncio.to_thread(raw_send, port, Hello(1, layout_hash).encode())
            refusal = error_frame(reply)
            assert refusal.code is ErrorCode.AUTH and "wrong or missing secret" in refusal.message
            # A member proven as node 2 cannot speak as node 1 either.
            _, sender = await authconn.create_connection(lambda: OutboundProtocol(4), "127.0.0.1", port, ADMIN,
                                                         plane=auth.Plane.DATA, me=auth.node(2), timeout=T)
            assert sender.transport is not None
            sender.transport.write(Hello(1, layout_hash).encode())
            reason = await asyncio.wait_for(sender.closed, T)
            assert "authenticated as node 2" in reason
            values = {i: np.full(nodes[1].layout.total, float(i), dtype=np.float32)  # type: ignore[union-attr]
                      for i in nodes}
            results = await one_iteration(nodes, values)
            for out in results.values():
                np.testing.assert_array_equal(out, np.full_like(out, 10.0))
            assert not any(node.down for node in nodes.values())
    uvloop.run(main())


def test_a_forged_up_chunk_from_an_unauthenticated_connection_never_reaches_the_sum() -> None:
    async def main() -> None:
        async with cluster([1, 2, 3], CONFIG, rollout([1, 2, 3]), credentials=ADMIN) as nodes:
            for node in nodes.values():
                await node.register(SPECS)
            layout = nodes[2].layout
            assert layout is not None
            count = min(layout.total, CONFIG.chunk_size)
            forged = b"".join(
                Hello(src, layout.hash).encode()
                + ChunkHeader(0, 0, root, Phase.UP, src, 2, src, 2, 0, 0.0, False, (src, 2), count).encode()
                + np.full(count, 1e6, dtype="<f4").tobytes()
                for src in (1, 3) for root in (2,))
            port = nodes[2]._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            for src in (1, 3):
                one = forged[:len(forged) // 2] if src == 1 else forged[len(forged) // 2:]
                refusal = error_frame(await asyncio.to_thread(raw_send, port, one))
                assert refusal.code is ErrorCode.AUTH
            values = {i: np.full(layout.total, float(i), dtype=np.float32) for i in nodes}
            results = await one_iteration(nodes, values)
            for out in results.values():
                np.testing.assert_array_equal(out, np.full_like(out, 6.0))
            assert not any(node.down for node in nodes.values())
    uvloop.run(main())


def test_a_node_without_the_secret_cannot_join_the_data_plane() -> None:
    async def main() -> None:
        async with cluster([1, 2], CONFIG, rollout([1, 2]), credentials=ADMIN) as nodes:
            port = nodes[2]._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            with pytest.raises(AuthError, match="wrong or missing secret"):
                await authconn.create_connection(lambda: OutboundProtocol(2), "127.0.0.1", port,
                                                 Credentials(WRONG), plane=auth.Plane.DATA, me=auth.node(1),
                                                 timeout=T)
    uvloop.run(main())


# --- trainer -------------------------------------------------------------------------------------------


def test_the_trainer_tcp_endpoint_refuses_a_client_without_the_secret(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NETSTORM_SECRET_FILE", raising=False)
    good, wrong = secret_file(tmp_path), secret_file(tmp_path, WRONG, "wrong.secret")
    tensors = {"w": np.arange(6, dtype=np.float32)}

    async def main() -> None:
        async with cluster([1, 2], CONFIG, rollout([1, 2]), credentials=ADMIN) as nodes:
            endpoints = [TrainerEndpoint(node, credentials=ADMIN) for node in nodes.values()]
            try:
                tcp = await endpoints[0].serve_tcp("127.0.0.1", 0)
                where = f"tcp://127.0.0.1:{tcp.sockets[0].getsockname()[1]}"
                sock_path = tmp_path / "node-2.sock"
                await endpoints[1].serve_unix(sock_path)
                assert stat.S_IMODE(sock_path.stat().st_mode) == 0o600

                def attempts() -> None:
                    with netstorm.connect(where, timeout=T) as client, \
                            pytest.raises(TrainerAuthError, match="wrong or missing secret"):
                        client.init(tensors)
                    with pytest.raises(TrainerAuthError, match="wrong or missing secret"):
                        netstorm.connect(where, timeout=T, secret_file=wrong)
                    raw = exchange(tcp.sockets[0].getsockname()[:2], struct.pack("<II", 10, 0) + b"x" * 10)
                    assert b"wrong or missing secret" in raw

                await asyncio.to_thread(attempts)

                async def trainer_2() -> dict[str, np.ndarray]:
                    async with await netstorm.aconnect(str(sock_path), timeout=T) as client:
                        return await client.init(tensors)

                def trainer_1() -> dict[str, np.ndarray]:
                    with netstorm.connect(where, timeout=T, secret_file=good) as client:
                        return client.init(tensors)
                first, second = await asyncio.gather(asyncio.to_thread(trainer_1), trainer_2())
                np.testing.assert_array_equal(first["w"], tensors["w"])
                np.testing.assert_array_equal(second["w"], tensors["w"])
            finally:
                for endpoint in endpoints:
                    endpoint.close()
    uvloop.run(main())


def test_the_async_client_proves_the_secret_over_tcp(tmp_path: Path) -> None:
    good = secret_file(tmp_path)

    async def main() -> None:
        async with cluster([1, 2], CONFIG, rollout([1, 2]), credentials=ADMIN) as nodes:
            endpoint = TrainerEndpoint(nodes[1], credentials=ADMIN)
            try:
                tcp = await endpoint.serve_tcp("127.0.0.1", 0)
                where = f"tcp://127.0.0.1:{tcp.sockets[0].getsockname()[1]}"
                with pytest.raises(TrainerAuthError, match="wrong or missing secret"):
                    await netstorm.aconnect(where, timeout=T, secret_file=secret_file(tmp_path, WRONG, "w"))
                client = await netstorm.aconnect(where, timeout=T, secret_file=good)
                await client.close()
            finally:
                endpoint.close()
    uvloop.run(main())


# --- the secret itself -----------------------------------------------------------------------------


def test_netstorm_secret_writes_a_private_file_and_refuses_to_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "job.secret"
    assert cli_main(["secret", str(path)]) == 0
    first = path.read_bytes()
    assert len(first) >= auth.MIN_SECRET_BYTES and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert cli_main(["secret", str(path)]) == 1
    assert path.read_bytes() == first
    assert cli_main(["secret", str(path), "--force"]) == 0
    assert path.read_bytes() != first
    assert Config(secret_file=str(path)).secret() == path.read_bytes()


def test_a_short_secret_is_a_clear_config_error(tmp_path: Path) -> None:
    path = secret_file(tmp_path, b"x" * 31)
    with pytest.raises(ConfigError, match="at least 32 bytes, this one has 31"):
        Config(secret_file=str(path)).validate()
    with pytest.raises(ConfigError, match="No such file"):
        Config(secret_file=str(tmp_path / "missing")).validate()
    with pytest.raises(ConfigError, match="wan_tls needs secret_file"):
        Config(wan_tls=True).validate()


# --- encrypted links -----------------------------------------------------------------------------------


def test_wan_tls_encrypts_data_and_control_links_and_still_authenticates_members(tmp_path: Path) -> None:
    path = tmp_path / "job.secret"
    assert cli_main(["secret", str(path), "--tls"]) == 0
    assert stat.S_IMODE(Path(f"{path}.key").stat().st_mode) == 0o600
    credentials = Credentials.from_config(Config(secret_file=str(path), wan_tls=True))
    assert credentials is not None and credentials.tls
    other = tmp_path / "other.secret"
    assert cli_main(["secret", str(other)]) == 0

    async def main() -> None:
        async with scheduler(credentials) as service:
            status = await admin.status(address(service), timeout=T, credentials=credentials)
            assert status.version == -1
            # The job certificate, but not the job secret: TLS lets it in, the handshake does not.
            impostor = Credentials(other.read_bytes(), credentials.certificate, credentials.key)
            with pytest.raises(ControlAuthError, match="wrong or missing secret"):
                await admin.status(address(service), timeout=T, credentials=impostor)
        # Frames of megabytes, several iterations: a TLS writer must resume after every frame.
        big = dataclasses.replace(CONFIG, chunk_size=250_000)
        async with cluster([1, 2, 3], big, rollout([1, 2, 3]), credentials=credentials) as nodes:
            for node in nodes.values():
                await node.register([TensorSpec("w", (1_500_000,), "float32"), *SPECS])
            for step in range(3):
                values = {i: np.full(nodes[1].layout.total, float(i + step), dtype=np.float32)  # type: ignore[union-attr]
                          for i in nodes}
                results = await one_iteration(nodes, values)
                for out in results.values():
                    np.testing.assert_array_equal(out, np.full_like(out, 6.0 + 3 * step))
            link = nodes[1].links[2].protocol
            assert link is not None and link.transport is not None
            assert link.transport.get_extra_info("ssl_object") is not None
            port = nodes[2]._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            # A plain-TCP peer without the job certificate does not get through the TLS handshake.
            reply = await asyncio.to_thread(raw_send, port, Hello(1, "").encode())
            assert not reply.startswith(b"NSF1")
            assert not any(node.down for node in nodes.values())
    uvloop.run(main())


def test_local_emulate_and_demo_hand_the_secret_to_every_process_they_start(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from netstorm.commands import demo, emulate, local
    from netstorm.emulation.runner import options_from_args

    secret = secret_file(tmp_path)
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    argv = demo.emulate_argv(parser.parse_args(["--secret-file", secret.name]))
    eparser = argparse.ArgumentParser()
    emulate.add_arguments(eparser)
    opts = options_from_args(eparser.parse_args(argv))
    assert opts.config_flags[opts.config_flags.index("--secret-file") + 1] == str(secret.resolve())
    assert opts.credentials is not None and opts.credentials.secret == SECRET
    lparser = argparse.ArgumentParser()
    local.add_arguments(lparser)
    flags = local.config_flags(lparser.parse_args(["internet2-9", "--secret-file", secret.name]))
    assert flags == ["--secret-file", str(secret.resolve())]


def test_the_trainer_unix_socket_is_the_owners_or_a_named_groups(tmp_path: Path) -> None:
    from node.service import GeneralNode

    async def main() -> None:
        endpoint = TrainerEndpoint(GeneralNode(1, CONFIG))
        try:
            await endpoint.serve_unix(tmp_path / "own.sock")
            await endpoint.serve_unix(tmp_path / "group.sock", group=os.getgid())
        finally:
            endpoint.close()
    uvloop.run(main())
    assert stat.S_IMODE((tmp_path / "own.sock").stat().st_mode) == 0o600
    shared = (tmp_path / "group.sock").stat()
    assert stat.S_IMODE(shared.st_mode) == 0o660 and shared.st_gid == os.getgid()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["group.sock", "own.sock"]  # no staging name left
