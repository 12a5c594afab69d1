"""Job membership proven on every TCP connection: a mutual challenge-response over one job secret.

See docs/ARCHITECTURE.md, *Trust*."""

from __future__ import annotations

import abc
import enum
import hashlib
import hmac
import os
import struct
from collections.abc import Callable, Collection
from typing import Annotated, ClassVar, Final, NoReturn

import msgspec

from netstorm.errors import AuthError, ConfigError, ErrorCode
from netstorm.schema import DECODE_ERRORS, NodeId, Text, stated, typed_error, unstated

MAGIC: Final = b"NSA1"
"""First bytes of every handshake message."""
VERSION: Final = 1
HEADER: Final = struct.Struct("<4sI")
"""magic | body length."""
MAX_MESSAGE: Final = 1024
"""Largest handshake message body accepted: a message is a few hundred bytes at most."""
NONCE_BYTES: Final = 32
PROOF_BYTES: Final = 32
MIN_SECRET_BYTES: Final = 32
DOMAIN: Final = b"netstorm job membership v1\x00"
"""Prefix of every MAC input: these MACs mean nothing to any other use of the same secret."""
FAILED: Final = "authentication failed: wrong or missing secret"
"""The words every side uses when a proof does not hold (which side's secret is wrong is not knowable)."""
UNAUTHENTICATED: Final = f"{FAILED} (the job secret is required here and the connection did not prove it)"
"""What a side with a secret tells a peer that spoke its plane's protocol without authenticating."""


class Plane(enum.StrEnum):
    """Which protocol the authenticated connection will carry (part of every proof)."""

    DATA = "data"
    CONTROL = "control"
    TRAINER = "trainer"


class Role(enum.StrEnum):
    NODE = "node"
    ADMIN = "admin"
    TRAINER = "trainer"
    SCHEDULER = "scheduler"


class Identity(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Who a side claims to be, and after the handshake has proven to be: a role and, for a node, its id."""

    role: Role
    id: NodeId = 0

    def __str__(self) -> str:
        return f"node {self.id}" if self.role is Role.NODE else str(self.role.value)


def node(node_id: int) -> Identity:
    return Identity(Role.NODE, node_id)


ADMIN: Final = Identity(Role.ADMIN)
TRAINER: Final = Identity(Role.TRAINER)
SCHEDULER: Final = Identity(Role.SCHEDULER)

Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
MAX_PROOF_BYTES: Final = 64
"""An HMAC (the shared secret) is 32 bytes, an Ed25519 signature (a member key) 64."""
Mac = Annotated[bytes, msgspec.Meta(min_length=PROOF_BYTES, max_length=MAX_PROOF_BYTES)]
MAX_CERTIFICATE: Final = 256
Certificate = Annotated[bytes, msgspec.Meta(max_length=MAX_CERTIFICATE)]
"""A member key's certificate (``netstorm.memberkeys``); empty with the shared secret."""


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", forbid_unknown_fields=True):
    """Base of the handshake messages; ``v`` is written by the encoder and checked at decode."""

    TYPE: ClassVar[str] = ""
    v: int = msgspec.field(default_factory=unstated(VERSION))

    def __post_init__(self) -> None:
        if self.v != VERSION:
            raise AuthError(f"unsupported handshake version {self.v!r} (this side speaks {VERSION})")


class Challenge(Message, frozen=True, tag="challenge"):
    plane: Plane
    identity: Identity
    nonce: Nonce


class Answer(Message, frozen=True, tag="answer", omit_defaults=True):
    identity: Identity
    nonce: Nonce
    proof: Mac
    certificate: Certificate = b""


class Proof(Message, frozen=True, tag="proof", omit_defaults=True):
    proof: Mac
    certificate: Certificate = b""


class Welcome(Message, frozen=True, tag="welcome"):
    pass


class Refusal(Message, frozen=True, tag="refusal"):
    message: Text
    code: ErrorCode = ErrorCode.AUTH


for _cls in (Challenge, Answer, Proof, Welcome, Refusal):
    _cls.TYPE = str(_cls.__struct_config__.tag)

_ENCODER = msgspec.msgpack.Encoder(enc_hook=lambda value: int(value))
_DECODER: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Challenge | Answer | Proof | Welcome | Refusal)
_TRANSCRIPT = msgspec.msgpack.Encoder()


def encode(message: Message) -> bytes:
    body = _ENCODER.encode(message)
    return HEADER.pack(MAGIC, len(body)) + body


def decode(body: bytes | bytearray | memoryview) -> Message:
    """One handshake message from its body; AuthError (MALFORMED words) for anything else."""
    try:
        message = _DECODER.decode(body)
    except AuthError:
        raise
    except DECODE_ERRORS as exc:
        raise typed_error(AuthError, "handshake message", exc) from None
    if not stated(message.v):
        raise AuthError(f"handshake message without a version (this side speaks {VERSION})")
    return message


def transcript(prover: str, plane: Plane, client_nonce: bytes, server_nonce: bytes, client: Identity,
               server: Identity) -> bytes:
    """What side ``prover`` ("client" or "server") proves: the whole transcript and its side."""
    return _TRANSCRIPT.encode([prover, plane.value, client_nonce, server_nonce,
                               [client.role.value, client.id], [server.role.value, server.id]])


def proof(secret: bytes, prover: str, plane: Plane, client_nonce: bytes, server_nonce: bytes,
          client: Identity, server: Identity) -> bytes:
    """The shared secret's proof: a MAC of the transcript."""
    return hmac.new(secret, DOMAIN + transcript(prover, plane, client_nonce, server_nonce, client, server),
                    hashlib.sha256).digest()


class Keys(abc.ABC):
    """What a side proves membership with: the shared job secret, or a member key of its own."""

    identity: Identity | None = None
    """The one identity these keys may prove (None: any, the shared secret)."""
    certificate: bytes = b""
    """Sent with every proof (a member key's certificate; empty for the shared secret)."""

    @abc.abstractmethod
    def prove(self, transcript: bytes) -> bytes:
        """This side's proof of ``transcript``."""

    @abc.abstractmethod
    def verify(self, claimed: Identity, transcript: bytes, proof: bytes, certificate: bytes) -> str | None:
        """None when ``proof`` proves ``claimed`` over ``transcript``; otherwise why not."""


class SharedSecret(Keys):
    """Every member holds the same secret: a proof shows membership, and the claimed id is trusted."""

    def __init__(self, secret: bytes) -> None:
        self._secret = check_secret(secret, "job secret")

    def prove(self, transcript: bytes) -> bytes:
        return hmac.new(self._secret, DOMAIN + transcript, hashlib.sha256).digest()

    def verify(self, claimed: Identity, transcript: bytes, proof: bytes, certificate: bytes) -> str | None:
        if certificate:
            return "it proves a member key and this side holds the shared job secret"
        return None if hmac.compare_digest(self.prove(transcript), proof) else "it does not prove the secret"


def check_secret(secret: bytes, where: str) -> bytes:
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"{where}: a job secret needs at least {MIN_SECRET_BYTES} bytes, this one has "
                          f"{len(secret)} (write a new one with `netstorm secret FILE`)")
    return secret


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """The secret a ``secret_file`` holds (its bytes, as they are); ConfigError names what is wrong."""
    try:
        with open(path, "rb") as file:
            data = file.read(1 << 20)
    except OSError as exc:
        raise ConfigError(f"secret_file {os.fspath(path)}: {exc.strerror or exc}") from None
    return check_secret(data, f"secret_file {os.fspath(path)}")


class State(enum.Enum):
    SEND_CHALLENGE = "client: challenge sent, waiting for the answer"
    AWAIT_CHALLENGE = "server: waiting for the challenge"
    AWAIT_PROOF = "server: answer sent, waiting for the client's proof"
    AWAIT_WELCOME = "client: proof sent, waiting for the welcome"
    DONE = "done"
    FAILED = "failed"


class Handshake:
    """One side of one connection's handshake, with no I/O.

    Feed it what arrives (``receive``, which says how many bytes it took: nothing after the handshake's
    last message), send what ``data_to_send`` returns, give up at ``deadline``. ``done`` with ``peer`` set
    once the other side proved membership and identity; every failure raises ``AuthError`` (after
    queueing a ``Refusal`` for the other side where it may be told).

    ``allowed`` (server side) is the set of roles that may use this plane; ``accept`` may refuse a
    proven identity for a reason of its own (the message it returns is sent back).
    """

    def __init__(self, secret: bytes | Keys, plane: Plane, me: Identity, *, client: bool, now: float, timeout: float,
                 allowed: Collection[Role] = (), accept: Callable[[Identity], str | None] | None = None,
                 nonce: bytes | None = None, peer_name: str = "peer") -> None:
        self._keys = secret if isinstance(secret, Keys) else SharedSecret(secret)
        own = self._keys.identity
        if own is not None and me.role is Role.TRAINER and own.role is Role.TRAINER:
            me = own  # a trainer proves the trainer identity its key was issued for
        if own is not None and own != me:
            raise AuthError(f"this process holds the member key of {own} and cannot prove {me}")
        self.plane = plane
        self.me = me
        self.client = client
        self.deadline = now + timeout
        self._timeout = timeout
        self._allowed = frozenset(allowed)
        self._accept = accept
        self._nonce = os.urandom(NONCE_BYTES) if nonce is None else nonce
        self._peer_nonce = b""
        self.peer_name = peer_name
        self._buffer = bytearray()
        self._out = bytearray()
        self.peer: Identity | None = None
        """The other side's identity, set only once it has proven it."""
        self._claimed: Identity | None = None
        self.foreign = False
        """The other side spoke another protocol first (it has no secret): the shell answers in that
        plane's own error form instead of a Refusal it would not read."""
        if client:
            self.state = State.SEND_CHALLENGE
            self._send(Challenge(plane=plane, identity=me, nonce=self._nonce))
        else:
            self.state = State.AWAIT_CHALLENGE

    @property
    def done(self) -> bool:
        return self.state is State.DONE

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    def wanted(self) -> int:
        """How many more bytes complete the message being received (for shells that read exactly)."""
        if len(self._buffer) < HEADER.size:
            return HEADER.size - len(self._buffer)
        _, length = HEADER.unpack_from(self._buffer)
        return HEADER.size + length - len(self._buffer)

    def check_timer(self, now: float) -> None:
        """Fail the handshake once its deadline has passed."""
        if self.state not in (State.DONE, State.FAILED) and now >= self.deadline:
            self._fail(f"authentication with {self.peer_name} did not complete within {self._timeout:g} s "
                       f"({self.state.value})", tell=False)

    def receive(self, data: bytes | bytearray | memoryview) -> int:
        """Take bytes from the other side; returns how many were part of the handshake."""
        taken = 0
        view = memoryview(data)
        while taken < len(view) and self.state not in (State.DONE, State.FAILED):
            need = self.wanted()
            chunk = view[taken:taken + need]
            self._buffer += chunk
            taken += len(chunk)
            if len(self._buffer) >= HEADER.size:
                magic, length = HEADER.unpack_from(self._buffer)
                if magic != MAGIC:
                    self._foreign(bytes(magic))
                if length > MAX_MESSAGE:
                    self._fail(f"handshake message of {length} bytes from {self.peer_name} exceeds {MAX_MESSAGE}")
                if len(self._buffer) == HEADER.size + length:
                    body = bytes(self._buffer[HEADER.size:])
                    self._buffer.clear()
                    self._handle(body)
        return taken

    # --- the protocol ---------------------------------------------------------------------------

    def _handle(self, body: bytes) -> None:
        try:
            message = decode(body)
        except AuthError as exc:
            self._fail(f"bad handshake message from {self.peer_name}: {exc}")
        if isinstance(message, Refusal):
            self._fail(f"{self.peer_name} refused us: {message.message}", tell=False)
        match self.state, message:
            case State.AWAIT_CHALLENGE, Challenge():
                self._challenge(message)
            case State.SEND_CHALLENGE, Answer():
                self._answer(message)
            case State.AWAIT_PROOF, Proof():
                self._proof(message)
            case State.AWAIT_WELCOME, Welcome():
                self.state = State.DONE
            case _:
                self._fail(f"unexpected {message.TYPE} from {self.peer_name} ({self.state.value})")

    def _challenge(self, message: Challenge) -> None:
        if message.plane is not self.plane:
            self._fail(f"{self.peer_name} wants the {message.plane} plane, this is the {self.plane} plane")
        if self._allowed and message.identity.role not in self._allowed:
            self._fail(f"{self.peer_name} claims to be {message.identity}, which may not use the {self.plane} plane")
        if message.nonce == self._nonce:
            self._fail(f"{self.peer_name} reflected this side's nonce")
        self._peer_nonce = message.nonce
        self._claimed = message.identity
        mac = self._keys.prove(transcript("server", self.plane, message.nonce, self._nonce, message.identity,
                                          self.me))
        self._send(Answer(identity=self.me, nonce=self._nonce, proof=mac, certificate=self._keys.certificate))
        self.state = State.AWAIT_PROOF

    def _answer(self, message: Answer) -> None:
        if message.nonce == self._nonce:
            self._fail(f"{self.peer_name} reflected this side's nonce")
        why = self._keys.verify(message.identity, transcript("server", self.plane, self._nonce, message.nonce,
                                                             self.me, message.identity),
                                message.proof, message.certificate)
        if why is not None:
            self._fail(f"{FAILED} ({self.peer_name} claiming to be {message.identity}: {why})")
        self.peer = message.identity
        mac = self._keys.prove(transcript("client", self.plane, self._nonce, message.nonce, self.me,
                                          message.identity))
        self._send(Proof(proof=mac, certificate=self._keys.certificate))
        self.state = State.AWAIT_WELCOME

    def _proof(self, message: Proof) -> None:
        claimed = self._claimed
        assert claimed is not None
        why = self._keys.verify(claimed, transcript("client", self.plane, self._peer_nonce, self._nonce, claimed,
                                                    self.me), message.proof, message.certificate)
        if why is not None:
            self._fail(f"{FAILED} ({self.peer_name} claiming to be {claimed}: {why})", told=FAILED)
        why = self._accept(claimed) if self._accept is not None else None
        if why is not None:
            self._fail(f"{claimed} at {self.peer_name} refused: {why}", told=why)
        self.peer = claimed
        self._send(Welcome())
        self.state = State.DONE

    def _send(self, message: Message) -> None:
        self._out += encode(message)

    def _foreign(self, first: bytes) -> NoReturn:
        self.foreign = True
        if self.client:
            self._fail(f"{FAILED}: {self.peer_name} answered without authenticating (it runs without a secret, "
                       "or is not a NetStorm process of this plane)", tell=False)
        self._fail(f"{FAILED}: {self.peer_name} did not authenticate (its first bytes {first!r} are no handshake: it "
                   "runs without a secret)", tell=False)

    def _fail(self, message: str, *, tell: bool = True, told: str | None = None) -> NoReturn:
        """Raise AuthError(message); ``told`` is what the other side hears (by default the same)."""
        self.state = State.FAILED
        if tell:
            self._send(Refusal(message=told if told is not None else message))
        raise AuthError(message)
