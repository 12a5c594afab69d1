"""The membership handshake (``netstorm.auth``) run on real connections, and the job's TLS contexts.

Three thin shells around the one sans-I/O ``Handshake``: on asyncio streams (control, admin, trainer
TCP), in front of an asyncio protocol (the data plane, whose receiver is a ``BufferedProtocol``: a
``ServerGate`` or ``ClientGate`` holds the transport until the handshake is done, then hands it to
the real protocol with ``set_protocol``), and on a blocking socket (the blocking trainer client).

``Credentials`` is what a process holds: the secret and, with ``wan_tls``, the job certificate. TLS,
when on, wraps the connection first; the handshake still runs inside it, so TLS only hides and protects
the bytes while the secret still decides who is a member and which id it may claim.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import os
import socket
import ssl
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

from netstorm.auth import UNAUTHENTICATED, Handshake, Identity, Keys, Plane, Role, load_secret
from netstorm.errors import AuthError, ConfigError

if TYPE_CHECKING:
    from netstorm.config import Config

P = TypeVar("P", bound=asyncio.BaseProtocol)
REFUSE_LINGER_S = 1.0
"""Seconds a refused connection stays half-open so the other side reads why before it sees the close."""

Refuse = Callable[[str], bytes]
"""The plane's own error frame for a peer that spoke that plane's protocol without authenticating."""


@dataclasses.dataclass(frozen=True)
class Credentials:
    """A process's proof of membership: the job secret (or its own member key) and, for encrypted
    links, the job certificate."""

    secret: bytes
    certificate: Path | None = None
    """The job's self-signed certificate (``netstorm secret FILE --tls`` writes FILE.crt); every side
    trusts exactly this certificate."""
    key: Path | None = None
    member: Keys | None = None
    """This process's own member key (``netstorm.memberkeys.MemberKeys``), which then replaces the shared
    secret on every TCP plane: it proves this member's identity and no other."""

    @classmethod
    def from_config(cls, config: Config) -> Credentials | None:
        """From a ``Config`` (``secret_file``, ``member_file``, ``revoked_file``, ``wan_tls``); None when
        the job runs without a secret."""
        if config.member_file:
            member = member_keys(config.member_file, config.revoked_file)
            secret = load_secret(config.secret_file) if config.secret_file else b""
        elif config.secret_file:
            member, secret = None, load_secret(config.secret_file)
        else:
            return None
        if not config.wan_tls:
            return cls(secret, member=member)
        certificate, key = tls_files(config.secret_file)
        for path in (certificate, key):
            if not path.is_file():
                raise ConfigError(f"wan_tls: {path} is missing (write it with `netstorm secret "
                                  f"{config.secret_file} --tls --force`)")
        return cls(secret, certificate, key, member=member)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str] | None) -> Credentials | None:
        """From a trainer's ``secret_file``: the shared secret, or the trainer's own member file."""
        if not path:
            return None
        with contextlib.suppress(OSError):
            with open(path, "rb") as file:
                head = file.read(64)
            from netstorm.memberkeys import is_member_file
            if is_member_file(head):
                return cls(b"", member=member_keys(path, ""))
        return cls(load_secret(path))

    @property
    def keys(self) -> Keys | bytes:
        """What the handshake proves with: the member key, or the shared secret."""
        return self.member if self.member is not None else self.secret

    def revoked(self, identity: Identity | None) -> bool:
        """Whether ``identity``, proven earlier, has been revoked since (member keys only)."""
        check = getattr(self.member, "revoked", None)
        return identity is not None and check is not None and bool(check(identity))


    @property
    def tls(self) -> bool:
        return self.certificate is not None

    def server_ssl(self) -> ssl.SSLContext | None:
        """Mutual TLS pinned to the job certificate (None without ``wan_tls``)."""
        if self.certificate is None or self.key is None:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.load_cert_chain(self.certificate, self.key)
        context.load_verify_locations(cafile=self.certificate)
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_ssl(self) -> ssl.SSLContext | None:
        if self.certificate is None or self.key is None:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.check_hostname = False  # peers are addressed by IP; the pinned certificate is the check
        context.load_verify_locations(cafile=self.certificate)
        context.load_cert_chain(self.certificate, self.key)
        return context


def member_keys(member_file: str | os.PathLike[str], revoked_file: str | os.PathLike[str]) -> Keys:
    """The member key in ``member_file``, checking others against the revocation list ``revoked_file``."""
    from netstorm.memberkeys import MemberKeys, Revocations, load_member  # loaded only for member keys
    return MemberKeys(load_member(member_file), Revocations(revoked_file or None))


def tls_files(secret_file: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Where the job certificate and its key sit: beside the secret, as SECRET.crt and SECRET.key."""
    base = os.fspath(secret_file)
    return Path(base + ".crt"), Path(base + ".key")


def _peer_name(writer: asyncio.StreamWriter | asyncio.BaseTransport) -> str:
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        host, port = str(peer[0]), int(peer[1])
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return str(peer)


# --- asyncio streams ------------------------------------------------------------------------------


async def _run_stream(handshake: Handshake, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      refuse: Refuse | None) -> Identity:
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout_at(handshake.deadline):
            writer.write(handshake.data_to_send())
            while not handshake.done:
                try:
                    data = await reader.readexactly(handshake.wanted())
                except (asyncio.IncompleteReadError, ConnectionError) as exc:
                    raise AuthError(f"authentication with {handshake.peer_name} failed: the connection closed "
                                    f"during authentication ({exc})") from None
                handshake.receive(data)
                writer.write(handshake.data_to_send())
            await writer.drain()
    except TimeoutError:
        with contextlib.suppress(AuthError):
            handshake.check_timer(loop.time())
        raise AuthError(f"authentication with {handshake.peer_name} did not complete within the handshake "
                        "deadline") from None
    except AuthError:
        refusal = handshake.data_to_send()
        if handshake.foreign and not handshake.client and refuse is not None:
            refusal = refuse(UNAUTHENTICATED)
        if refusal and not writer.is_closing():
            writer.write(refusal)
            await linger(reader, writer)
        raise
    assert handshake.peer is not None
    return handshake.peer


async def linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Let the other side read the refusal: half-close, drain (and drop) its input briefly (closing with
    unread input would reset the connection and lose the refusal), then the caller closes."""
    with contextlib.suppress(OSError, RuntimeError, NotImplementedError, TimeoutError):
        async with asyncio.timeout(REFUSE_LINGER_S):
            await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
            while await reader.read(1 << 16):
                pass


async def client_stream(credentials: Credentials, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                        plane: Plane, me: Identity, timeout: float) -> Identity:  # noqa: ASYNC109 (the handshake deadline)
    """Authenticate a connection this side opened; the server's proven identity."""
    handshake = Handshake(credentials.keys, plane, me, client=True, now=asyncio.get_running_loop().time(),
                          timeout=timeout, peer_name=_peer_name(writer))
    return await _run_stream(handshake, reader, writer, None)


async def server_stream(credentials: Credentials, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                        plane: Plane, me: Identity, timeout: float, allowed: Collection[Role],  # noqa: ASYNC109
                        refuse: Refuse, accept: Callable[[Identity], str | None] | None = None) -> Identity:
    """Authenticate a connection this side accepted; the client's proven identity. ``refuse`` answers a
    client that spoke the plane's protocol without authenticating, in that protocol's error form."""
    handshake = Handshake(credentials.keys, plane, me, client=False, now=asyncio.get_running_loop().time(),
                          timeout=timeout, allowed=allowed, accept=accept, peer_name=_peer_name(writer))
    return await _run_stream(handshake, reader, writer, refuse)


async def open_stream(host: str, port: int, credentials: Credentials | None, *, plane: Plane, me: Identity,
                      timeout: float, tls: bool = True) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:  # noqa: ASYNC109
    """``asyncio.open_connection``, authenticated when there are credentials (and encrypted when they
    hold the job certificate and ``tls``); the caller bounds the whole call with its own deadline."""
    context = credentials.client_ssl() if credentials is not None and tls else None
    reader, writer = await asyncio.open_connection(host, port, ssl=context, server_hostname="" if context else None)
    if credentials is not None:
        try:
            await client_stream(credentials, reader, writer, plane=plane, me=me, timeout=timeout)
        except BaseException:
            writer.close()
            raise
    return reader, writer


# --- asyncio protocols (the data plane) ---------------------------------------------------------


def _hand_over(transport: asyncio.BaseTransport, protocol: asyncio.BaseProtocol, rest: bytes) -> None:
    """Give ``transport`` to ``protocol`` as if it had just been made, with bytes already received."""
    transport.set_protocol(protocol)
    protocol.connection_made(transport)
    if not rest:
        return
    if isinstance(protocol, asyncio.BufferedProtocol):
        view = memoryview(rest)
        while view:
            buffer = memoryview(protocol.get_buffer(len(view)))
            n = min(len(buffer), len(view))
            buffer[:n] = view[:n]
            protocol.buffer_updated(n)
            view = view[n:]
    elif isinstance(protocol, asyncio.Protocol):
        protocol.data_received(rest)


class _Gate(asyncio.Protocol, abc.ABC):
    """Holds a new connection while its handshake runs."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.handshake: Handshake | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._failed = False

    def _start(self, transport: asyncio.BaseTransport, handshake: Handshake) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.handshake = handshake
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(handshake.deadline, self._expire)
        self._flush()

    def _flush(self) -> None:
        assert self.transport is not None and self.handshake is not None
        out = self.handshake.data_to_send()
        if out:
            self.transport.write(out)

    def _expire(self) -> None:
        assert self.handshake is not None
        try:
            self.handshake.check_timer(asyncio.get_running_loop().time())
        except AuthError as exc:
            self._failure(exc)

    def data_received(self, data: bytes) -> None:
        if self._failed or self.handshake is None:
            return
        try:
            taken = self.handshake.receive(data)
        except AuthError as exc:
            self._failure(exc)
            return
        self._flush()
        if self.handshake.done:
            if self._timer is not None:
                self._timer.cancel()
            self._passed(data[taken:])

    @abc.abstractmethod
    def _passed(self, rest: bytes) -> None:
        """The handshake succeeded: hand the transport (and ``rest``, bytes already past it) on."""

    def _failure(self, exc: AuthError) -> None:
        self._failed = True
        if self._timer is not None:
            self._timer.cancel()

    def _close_after_refusal(self, refusal: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if refusal:
            transport.write(refusal)
        if refusal and transport.can_write_eof():
            with contextlib.suppress(OSError, RuntimeError):
                transport.write_eof()
            asyncio.get_running_loop().call_later(REFUSE_LINGER_S, transport.close)
        else:
            transport.close()

    def eof_received(self) -> bool | None:
        if self.transport is not None:
            self.transport.close()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()


class ServerGate(_Gate):
    """The accepting side: runs the handshake, then hands the connection to ``inner(peer identity)``.

    A client that fails is refused (a Refusal, or the plane's own error frame when it spoke the plane's
    protocol without authenticating) and never meets ``inner``; ``on_refused`` hears why."""

    def __init__(self, credentials: Credentials, *, plane: Plane, me: Identity, allowed: Collection[Role],
                 timeout: float, inner: Callable[[Identity], asyncio.BaseProtocol], refuse: Refuse,
                 on_refused: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self._credentials = credentials
        self._plane = plane
        self._me = me
        self._allowed = allowed
        self._timeout = timeout
        self._inner = inner
        self._refuse = refuse
        self._on_refused = on_refused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        handshake = Handshake(self._credentials.keys, self._plane, self._me, client=False,
                              now=asyncio.get_running_loop().time(), timeout=self._timeout, allowed=self._allowed,
                              peer_name=_peer_name(transport))
        self._start(transport, handshake)

    def _passed(self, rest: bytes) -> None:
        assert self.transport is not None and self.handshake is not None and self.handshake.peer is not None
        _hand_over(self.transport, self._inner(self.handshake.peer), rest)

    def _failure(self, exc: AuthError) -> None:
        super()._failure(exc)
        assert self.handshake is not None
        refusal = self.handshake.data_to_send()
        if self.handshake.foreign:
            refusal = self._refuse(UNAUTHENTICATED)
        if self._on_refused is not None:
            self._on_refused(str(exc))
        self._close_after_refusal(refusal)


class ClientGate(_Gate):
    """The connecting side: ``result`` resolves to the server's identity, or fails with AuthError."""

    def __init__(self, credentials: Credentials, *, plane: Plane, me: Identity, timeout: float) -> None:
        super().__init__()
        self._credentials = credentials
        self._plane = plane
        self._me = me
        self._timeout = timeout
        self.rest = b""
        self.result: asyncio.Future[Identity] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        handshake = Handshake(self._credentials.keys, self._plane, self._me, client=True,
                              now=asyncio.get_running_loop().time(), timeout=self._timeout,
                              peer_name=_peer_name(transport))
        self._start(transport, handshake)

    def _passed(self, rest: bytes) -> None:
        assert self.handshake is not None and self.handshake.peer is not None
        self.rest = rest
        if not self.result.done():
            self.result.set_result(self.handshake.peer)

    def _failure(self, exc: AuthError) -> None:
        super()._failure(exc)
        assert self.handshake is not None
        if not self.result.done():
            self.result.set_exception(exc)
        self._close_after_refusal(self.handshake.data_to_send())

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if not self.result.done():
            self.result.set_exception(AuthError(f"authentication failed: the connection closed during "
                                                f"authentication{f' ({exc})' if exc else ''}"))


async def create_connection(factory: Callable[[], P], host: str, port: int, credentials: Credentials | None, *,
                            plane: Plane, me: Identity, timeout: float) -> tuple[asyncio.Transport, P]:  # noqa: ASYNC109
    """``loop.create_connection`` whose protocol meets the connection only once the server has proven
    membership (and, with the job certificate, inside TLS); without credentials, exactly the plain call."""
    loop = asyncio.get_running_loop()
    if credentials is None:
        transport, protocol = await loop.create_connection(factory, host, port)
        return transport, protocol
    context = credentials.client_ssl()
    transport, gate = await loop.create_connection(
        lambda: ClientGate(credentials, plane=plane, me=me, timeout=timeout), host, port, ssl=context,
        server_hostname="" if context else None, ssl_handshake_timeout=timeout if context else None)
    try:
        await gate.result
    except BaseException:
        transport.close()
        raise
    protocol = factory()
    _hand_over(transport, protocol, gate.rest)
    return transport, protocol


def server_factory(credentials: Credentials | None, inner: Callable[[Identity | None], asyncio.BaseProtocol], *,
                   plane: Plane, me: Identity, allowed: Collection[Role], timeout: float, refuse: Refuse,
                   on_refused: Callable[[str], None] | None = None) -> Callable[[], asyncio.BaseProtocol]:
    """The protocol factory for ``loop.create_server``: ``inner(None)`` without credentials, else a gate
    that calls ``inner(proven identity)`` once the client is authenticated."""
    if credentials is None:
        return lambda: inner(None)
    return lambda: ServerGate(credentials, plane=plane, me=me, allowed=allowed, timeout=timeout, inner=inner,
                              refuse=refuse, on_refused=on_refused)


# --- a blocking socket (the blocking trainer client) ---------------------------------------------


def client_socket(credentials: Credentials, sock: socket.socket, *, plane: Plane, me: Identity,
                  timeout: float) -> Identity:
    """Authenticate a connected blocking socket; the server's identity (AuthError on failure)."""
    handshake = Handshake(credentials.keys, plane, me, client=True, now=time.monotonic(), timeout=timeout,
                          peer_name=str(sock.getpeername()))
    previous = sock.gettimeout()
    try:
        while True:
            out = handshake.data_to_send()
            if out:
                sock.sendall(out)
            if handshake.done:
                break
            left = handshake.deadline - time.monotonic()
            if left <= 0:
                handshake.check_timer(time.monotonic())
            sock.settimeout(left)
            data = sock.recv(handshake.wanted())
            if not data:
                raise AuthError("authentication failed: the node closed the connection during authentication")
            handshake.receive(data)
    except TimeoutError:
        raise AuthError(f"authentication with the node did not complete within {timeout:g} s") from None
    except AuthError:
        with contextlib.suppress(OSError):
            out = handshake.data_to_send()
            if out:
                sock.sendall(out)
        raise
    finally:
        sock.settimeout(previous)
    assert handshake.peer is not None
    return handshake.peer
