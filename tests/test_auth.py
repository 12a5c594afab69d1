"""The membership handshake as plain calls: who proves what, and what an attacker gets out of it."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from netstorm import auth
from netstorm.auth import ADMIN, SCHEDULER, Handshake, Plane, Role
from netstorm.errors import AuthError, ConfigError, ErrorCode

SECRET = b"s" * 32
OTHER = b"o" * 32
NODE3 = auth.node(3)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def pair(client_secret: bytes = SECRET, server_secret: bytes = SECRET, *, me: auth.Identity = NODE3,
         plane: Plane = Plane.CONTROL, allowed: tuple[Role, ...] = (Role.NODE, Role.ADMIN),
         now: float = 0.0) -> tuple[Handshake, Handshake]:
    client = Handshake(client_secret, plane, me, client=True, now=now, timeout=5.0)
    server = Handshake(server_secret, plane, SCHEDULER, client=False, now=now, timeout=5.0, allowed=allowed)
    return client, server


def run(client: Handshake, server: Handshake) -> None:
    """Shuttle bytes until both are done (or one raises)."""
    for _ in range(4):
        server.receive(client.data_to_send())
        client.receive(server.data_to_send())
        if client.done and server.done:
            return


def test_both_sides_learn_the_proven_identity() -> None:
    client, server = pair()
    run(client, server)
    assert client.done and server.done
    assert server.peer == auth.node(3)
    assert client.peer == SCHEDULER
    assert client.data_to_send() == b"" and server.data_to_send() == b""


def test_wrong_secret_fails_on_both_sides_with_the_clear_message() -> None:
    client, server = pair(client_secret=OTHER)
    server.receive(client.data_to_send())
    with pytest.raises(AuthError, match="authentication failed: wrong or missing secret") as raised:
        client.receive(server.data_to_send())
    assert raised.value.code is ErrorCode.AUTH
    with pytest.raises(AuthError, match="wrong or missing secret"):  # the client's refusal reaches the server
        server.receive(client.data_to_send())
    assert (not server.done and server.peer is None) or not server.done


def test_a_client_without_the_secret_cannot_forge_a_proof_for_the_server() -> None:
    """A client that answers correctly formed but wrong proof is refused, and told why."""
    client, server = pair()
    server.receive(client.data_to_send())
    client.receive(server.data_to_send())
    genuine = client.data_to_send()
    forged = auth.encode(auth.Proof(proof=bytes(32)))
    assert len(forged) == len(genuine)
    with pytest.raises(AuthError, match="wrong or missing secret"):
        server.receive(forged)
    assert server.peer is None and not server.done
    refusal = auth.decode(server.data_to_send()[auth.HEADER.size:])
    assert isinstance(refusal, auth.Refusal) and refusal.code is ErrorCode.AUTH
    with pytest.raises(AuthError, match="refused us: authentication failed: wrong or missing secret"):
        client.receive(auth.encode(refusal))


def test_a_replayed_transcript_fails() -> None:
    """An attacker who recorded node 3's whole handshake replays the client's messages on a new
    connection: the server's nonce is fresh, so the old proof does not hold."""
    client, server = pair()
    challenge = client.data_to_send()
    server.receive(challenge)
    client.receive(server.data_to_send())
    proof = client.data_to_send()
    server.receive(proof)
    assert server.done

    replay = Handshake(SECRET, Plane.CONTROL, SCHEDULER, client=False, now=0.0, timeout=5.0, allowed=(Role.NODE,))
    replay.receive(challenge)
    replay.data_to_send()
    with pytest.raises(AuthError, match="wrong or missing secret"):
        replay.receive(proof)
    assert replay.peer is None and not replay.done


def test_a_proof_is_bound_to_the_claimed_identity_and_plane() -> None:
    """A proof made for node 3 is no proof for node 1, nor on another plane, nor reflected."""
    args = (Plane.CONTROL, b"c" * 32, b"s" * 32, auth.node(3), SCHEDULER)
    genuine = auth.proof(SECRET, "client", *args)
    assert genuine != auth.proof(SECRET, "client", Plane.CONTROL, b"c" * 32, b"s" * 32, auth.node(1), SCHEDULER)
    assert genuine != auth.proof(SECRET, "client", Plane.DATA, *args[1:])
    assert genuine != auth.proof(SECRET, "server", *args)
    assert genuine != auth.proof(SECRET, "client", Plane.CONTROL, b"s" * 32, b"c" * 32, auth.node(3), SCHEDULER)


def test_a_server_refuses_roles_its_plane_does_not_serve() -> None:
    client, server = pair(me=auth.TRAINER)
    with pytest.raises(AuthError, match="trainer, which may not use the control plane"):
        server.receive(client.data_to_send())


def test_accept_may_refuse_a_proven_identity() -> None:
    client = Handshake(SECRET, Plane.DATA, auth.node(4), client=True, now=0.0, timeout=5.0)
    server = Handshake(SECRET, Plane.DATA, auth.node(1), client=False, now=0.0, timeout=5.0,
                       allowed=(Role.NODE,), accept=lambda who: "not a member of this job")
    server.receive(client.data_to_send())
    client.receive(server.data_to_send())
    with pytest.raises(AuthError, match="not a member"):
        server.receive(client.data_to_send())
    assert server.peer is None
    with pytest.raises(AuthError, match="refused us: not a member"):
        client.receive(server.data_to_send())


def test_a_client_that_speaks_the_plane_without_a_secret_is_foreign() -> None:
    server = Handshake(SECRET, Plane.DATA, auth.node(1), client=False, now=0.0, timeout=5.0)
    with pytest.raises(AuthError, match="did not authenticate") as raised:
        server.receive(b"NSF1\x01\x01\x10\x00\x00\x00\x00\x00\x00\x00")
    assert server.foreign and "wrong or missing secret" in str(raised.value)
    assert server.data_to_send() == b""  # the shell answers in the plane's own error form


def test_a_server_without_a_secret_answers_in_its_own_protocol() -> None:
    client = Handshake(SECRET, Plane.CONTROL, ADMIN, client=True, now=0.0, timeout=5.0)
    client.data_to_send()
    with pytest.raises(AuthError, match="answered without authenticating"):
        client.receive(b"\x10\x00\x00\x00" + b"\x00" * 16)


def test_the_handshake_has_a_deadline() -> None:
    client, server = pair(now=100.0)
    server.receive(client.data_to_send())
    server.check_timer(104.9)
    with pytest.raises(AuthError, match="did not complete within 5 s"):
        server.check_timer(105.0)


def test_oversized_and_garbled_messages_fail_before_being_buffered() -> None:
    server = Handshake(SECRET, Plane.DATA, auth.node(1), client=False, now=0.0, timeout=5.0)
    with pytest.raises(AuthError, match="exceeds"):
        server.receive(auth.HEADER.pack(auth.MAGIC, 1 << 30))
    server = Handshake(SECRET, Plane.DATA, auth.node(1), client=False, now=0.0, timeout=5.0)
    with pytest.raises(AuthError, match="bad handshake message"):
        server.receive(auth.HEADER.pack(auth.MAGIC, 3) + b"\x93\x01\x02")


def test_bytes_after_the_handshake_are_left_for_the_plane() -> None:
    client, server = pair()
    server.receive(client.data_to_send())
    client.receive(server.data_to_send())
    proof = client.data_to_send()
    assert server.receive(proof + b"first frame") == len(proof)
    assert server.done


def test_short_secrets_are_refused() -> None:
    with pytest.raises(ConfigError, match="at least 32 bytes"):
        Handshake(b"short", Plane.DATA, ADMIN, client=True, now=0.0, timeout=1.0)


def test_messages_round_trip_and_refuse_unknown_versions() -> None:
    message = auth.Challenge(plane=Plane.DATA, identity=auth.node(7), nonce=b"n" * 32)
    assert auth.decode(auth.encode(message)[auth.HEADER.size:]) == message
    raw = msgspec.msgpack.encode({"v": 2, "type": "welcome"})
    with pytest.raises(AuthError, match="version"):
        auth.decode(raw)
    with pytest.raises(AuthError, match="without a version"):
        auth.decode(msgspec.msgpack.encode({"type": "welcome"}))
    with pytest.raises(AuthError):
        auth.decode(msgspec.msgpack.encode({"v": 1, "type": "challenge", "plane": "data", "identity": ["node", 1],
                                            "nonce": b"short"}))


@FUZZ
@given(data=st.binary(max_size=400))
def test_fuzz_decoder_raises_only_auth_errors(data: bytes) -> None:
    with contextlib.suppress(AuthError):
        auth.decode(data)


@FUZZ
@given(data=st.binary(max_size=600), client=st.booleans())
def test_fuzz_handshake_never_completes_on_garbage(data: bytes, client: bool) -> None:
    """Bytes from someone without the secret never make either side done, and only AuthError escapes."""
    side = Handshake(SECRET, Plane.DATA, auth.node(1), client=client, now=0.0, timeout=5.0)
    side.data_to_send()
    try:
        taken = side.receive(auth.HEADER.pack(auth.MAGIC, len(data)) + data if data[:1] == b"\x00" else data)
        assert taken >= 0
    except AuthError:
        pass
    assert not side.done


MSGPACK_INTS = st.integers(min_value=-2**63, max_value=2**64 - 1)
TYPES = st.sampled_from(["challenge", "answer", "proof", "welcome", "refusal"])
FIELDS = {"plane": st.text(max_size=8), "nonce": st.binary(max_size=40), "proof": st.binary(max_size=40),
          "identity": st.lists(st.one_of(MSGPACK_INTS, st.text(max_size=8)), max_size=3),
          "message": st.text(max_size=20)}


@FUZZ
@given(body=st.fixed_dictionaries({"v": st.just(1), "type": TYPES}, optional=FIELDS))
def test_fuzz_well_formed_envelopes(body: dict[str, object]) -> None:
    with contextlib.suppress(AuthError):
        auth.decode(msgspec.msgpack.encode(body))
