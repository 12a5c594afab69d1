"""Per-member credentials on every TCP plane: each node, trainer, admin and the scheduler holds its own
key, issued by `netstorm secret`. A member holding node 3's key proves node 3 and nothing else (it is
refused as any other node, the admin, a trainer, the scheduler), a key from another authority proves
nothing, a revoked member is refused (and its live connection closed) while everyone else goes on
without a new key, and the shared-secret mode still works beside it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import uvloop

import netstorm
from netstorm import auth, authconn, control
from netstorm.auth import Handshake, Identity, Plane
from netstorm.authconn import Credentials, member_keys
from netstorm.cli import main as cli_main
from netstorm.control import ControlAuthError
from netstorm.errors import AuthError, ErrorCode
from netstorm.memberkeys import MemberKeys, Revocations, issue, load_member, new_authority
from node.control_client import SchedulerClient
from node.peers import OutboundProtocol
from node.trainer_endpoint import TrainerEndpoint
from scheduler import admin
from tests.dataplane import cluster, until
from tests.test_peers import CONFIG, SPECS, one_iteration, rollout
from tests.test_scheduler_service import FAST, T, addr
from tests.test_scheduler_service import scheduler as shared_scheduler

NAMES = ("scheduler", "admin", "node:1", "node:2", "node:3", "node:4", "trainer:1", "trainer:2")


@dataclasses.dataclass
class Job:
    """One authority's member files under ``root`` (written with the CLI) and the revocation list."""

    root: Path

    def file(self, name: str) -> Path:
        return self.root / name.replace(":", "-")

    @property
    def revoked(self) -> Path:
        return self.root / "revoked"

    def credentials(self, name: str) -> Credentials:
        return Credentials(b"", member=member_keys(self.file(name), self.revoked))


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    root = tmp_path_factory.mktemp("members")
    assert cli_main(["secret", str(root / "authority"), "--new-authority"]) == 0
    for name in NAMES:
        assert cli_main(["secret", str(root / name.replace(":", "-")), "--issue", name,
                         "--authority", str(root / "authority")]) == 0
        assert (root / name.replace(":", "-")).stat().st_mode & 0o777 == 0o600
    (root / "revoked").write_text("")
    yield Job(root)


class Impostor(MemberKeys):
    """A member that skips its own side's check: it claims any identity with the key it holds."""

    def __init__(self, keys: MemberKeys) -> None:
        super().__init__(keys.member, keys.revocations)
        self.identity = None


def impostor(job: Job, name: str) -> Credentials:
    keys = job.credentials(name).member
    assert isinstance(keys, MemberKeys)
    return Credentials(b"", member=Impostor(keys))


def _handshake(client_keys: auth.Keys, claims: Identity, server_keys: auth.Keys) -> Identity:
    """Run the sans-I/O handshake between two sides in memory; the identity the server accepted."""
    client = Handshake(client_keys, Plane.CONTROL, claims, client=True, now=0.0, timeout=5)
    server = Handshake(server_keys, Plane.CONTROL, auth.SCHEDULER, client=False, now=0.0, timeout=5)
    while not (client.done and server.done):
        server.receive(client.data_to_send())
        client.receive(server.data_to_send())
    assert server.peer is not None
    return server.peer


def test_a_member_key_proves_its_own_identity_and_no_other(job: Job, tmp_path: Path) -> None:
    scheduler = job.credentials("scheduler").keys
    node3 = job.credentials("node:3").keys
    assert isinstance(scheduler, MemberKeys) and isinstance(node3, MemberKeys)
    assert _handshake(node3, auth.node(3), scheduler) == auth.node(3)
    with pytest.raises(AuthError, match="holds the member key of node 3 and cannot prove node 2"):
        Handshake(node3, Plane.CONTROL, auth.node(2), client=True, now=0.0, timeout=5)
    for claimed in (auth.node(2), auth.ADMIN, auth.SCHEDULER, Identity(auth.Role.TRAINER, 1)):
        with pytest.raises(AuthError, match=f"certificate is node 3's, not {claimed}'s"):
            _handshake(Impostor(node3), claimed, scheduler)
    # The server side too: node 3's key cannot answer as the scheduler.
    with pytest.raises(AuthError, match="certificate is node 3's, not scheduler's"):
        _handshake(job.credentials("node:1").keys, auth.node(1), Impostor(node3))  # type: ignore[arg-type]
    # A key of another authority proves nothing; nor does the shared secret against a member key.
    stranger = MemberKeys(issue(new_authority(), auth.node(3)))
    with pytest.raises(AuthError, match="not signed by this job's authority"):
        _handshake(stranger, auth.node(3), scheduler)
    with pytest.raises(AuthError, match="shared job secret"):
        _handshake(bytes(48), auth.node(3), scheduler)  # type: ignore[arg-type]
    with pytest.raises(AuthError, match="claiming to be scheduler: it proves the shared job secret"):
        _handshake(node3, auth.node(3), auth.SharedSecret(bytes(48)))
    # Revoked: refused from the next handshake, without any other member's key changing.
    revoked = tmp_path / "revoked"
    revoked.write_text("")
    checking = MemberKeys(scheduler.member, Revocations(revoked))
    assert _handshake(node3, auth.node(3), checking) == auth.node(3)
    assert cli_main(["secret", str(revoked), "--revoke", str(job.file("node:3"))]) == 0
    assert checking.revoked(auth.node(3))
    with pytest.raises(AuthError, match="is revoked"):
        _handshake(node3, auth.node(3), checking)
    assert _handshake(job.credentials("node:4").keys, auth.node(4), checking) == auth.node(4)  # type: ignore[arg-type]


def test_control_and_admin_planes_take_each_members_own_key_and_revocation(job: Job) -> None:
    async def main() -> None:
        async with shared_scheduler(FAST, (1, 2, 3, 4), credentials=job.credentials("scheduler")) as service:
            async def register(n: int, credentials: Credentials) -> SchedulerClient:
                return await SchedulerClient.connect(addr(service), n, ("127.0.0.1", 40000 + n), timeout=T,
                                                     credentials=credentials)

            # Node 3's key cannot register node 2, nor act as the admin.
            with pytest.raises(ControlAuthError, match="wrong or missing secret"):
                await register(2, impostor(job, "node:3"))
            with pytest.raises(ControlAuthError):
                await admin.request(addr(service), control.StatusRequest(), timeout=T,
                                    credentials=impostor(job, "node:3"))
            assert service.membership.registered == ()
            clients = {n: c for n, c in zip((1, 2, 3, 4), await asyncio.gather(
                *(register(n, job.credentials(f"node:{n}")) for n in (1, 2, 3, 4))), strict=True)}
            try:
                status = await admin.request(addr(service), control.StatusRequest(), timeout=T,
                                             credentials=job.credentials("admin"))
                assert isinstance(status, control.Status) and status.alive == (1, 2, 3, 4)
                # Revoke node 4 while it runs: its connection closes at its next heartbeat, and its key
                # is refused from then on; the others keep their keys and their job.
                assert cli_main(["secret", str(job.revoked), "--revoke", str(job.file("node:4"))]) == 0
                await until(lambda: 4 not in service.membership.alive, "node 4 dropped", T)
                with pytest.raises(ControlAuthError, match="wrong or missing secret"):
                    await register(4, job.credentials("node:4"))
                policies = await asyncio.gather(*(clients[n].policy_for(10, timeout=T) for n in (1, 2, 3)))
                assert len({p.version for p in policies}) == 1
                assert set(service.membership.alive) == {1, 2, 3}
            finally:
                for client in clients.values():
                    await client.close()
                job.revoked.write_text("")

    uvloop.run(main())


def test_data_and_trainer_planes_take_each_members_own_key(job: Job) -> None:
    tensors = {"w": np.arange(6, dtype=np.float32)}

    async def main() -> None:
        own = {n: job.credentials(f"node:{n}") for n in (1, 2, 3)}
        async with cluster([1, 2, 3], CONFIG, rollout([1, 2, 3]), credentials=own) as nodes:
            for node in nodes.values():
                await node.register(SPECS)
            port = nodes[1]._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            # Node 3's key cannot open node 1's data plane as node 2.
            with pytest.raises(AuthError, match="wrong or missing secret"):
                await authconn.create_connection(lambda: OutboundProtocol(1), "127.0.0.1", port,
                                                 impostor(job, "node:3"), plane=auth.Plane.DATA, me=auth.node(2),
                                                 timeout=T)
            layout = nodes[1].layout
            assert layout is not None
            values = {i: np.full(layout.total, float(i), dtype=np.float32) for i in nodes}
            for out in (await one_iteration(nodes, values)).values():
                np.testing.assert_array_equal(out, np.full_like(out, 6.0))
    uvloop.run(main())

    async def trainers() -> None:
        own = {n: job.credentials(f"node:{n}") for n in (1, 2)}
        async with cluster([1, 2], CONFIG, rollout([1, 2]), credentials=own) as nodes:
            endpoints = {n: TrainerEndpoint(node, credentials=own[n]) for n, node in nodes.items()}
            try:
                ports = {n: (await e.serve_tcp("127.0.0.1", 0)).sockets[0].getsockname()[1]
                         for n, e in endpoints.items()}
                # Node 2's key cannot pose as a trainer, neither through the client nor by claiming it.
                with pytest.raises(netstorm.errors.TrainerAuthError):
                    await asyncio.to_thread(netstorm.connect, f"tcp://127.0.0.1:{ports[1]}", timeout=T,
                                            secret_file=str(job.file("node:2")))
                with pytest.raises(AuthError, match="wrong or missing secret"):
                    await authconn.open_stream("127.0.0.1", ports[1], impostor(job, "node:2"),
                                               plane=auth.Plane.TRAINER, me=auth.TRAINER, timeout=T)

                def trainer(n: int) -> dict[str, np.ndarray]:
                    with netstorm.connect(f"tcp://127.0.0.1:{ports[n]}", timeout=T,
                                          secret_file=str(job.file(f"trainer:{n}"))) as client:
                        return client.init(tensors)
                results = await asyncio.gather(*(asyncio.to_thread(trainer, n) for n in (1, 2)))
                for result in results:
                    np.testing.assert_array_equal(result["w"], tensors["w"])
            finally:
                for endpoint in endpoints.values():
                    endpoint.close()
    uvloop.run(trainers())


def test_a_member_file_names_its_identity_and_serial(job: Job) -> None:
    member = load_member(job.file("node:3"))
    assert member.identity == auth.node(3) and member.certificate.identity == auth.node(3)
    assert load_member(job.file("node:4")).certificate.serial != member.certificate.serial
    assert ErrorCode.AUTH  # the refusals above carry the authentication code
