"""Per-member credentials: each node, trainer, admin and the scheduler holds a key of its own.

Beside the shared job secret (``netstorm.auth.SharedSecret``, the default), a job may be run with one
key per member. ``netstorm secret AUTHORITY --new-authority`` writes the job's authority (an Ed25519
signing key, kept by whoever issues credentials); ``netstorm secret FILE --issue node:3 --authority
AUTHORITY`` writes node 3's member file: its own Ed25519 key, a certificate (identity, public key,
serial) signed by the authority, and the authority's public key. A proof in the handshake is then the
member's signature over the transcript, sent with its certificate; the other side checks the
certificate against the authority, that it names the identity claimed, that its serial is not
revoked, and the signature against the certificate's key. So holding node 3's key proves node 3 and
nothing else, and revoking one member (its serial in the job's revocation list, ``revoked_file``) needs
no new key for anyone else.

The files are msgspec JSON (mode 0600); a member file is told from a shared secret by its first bytes.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Annotated, Final

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from netstorm.auth import Identity, Keys, Role
from netstorm.errors import ConfigError
from netstorm.schema import DECODE_ERRORS

MEMBER_KIND: Final = "netstorm-member-v1"
AUTHORITY_KIND: Final = "netstorm-authority-v1"
MEMBER_MARK: Final = b'{"kind":"' + MEMBER_KIND.encode()
"""How a member file starts (msgspec writes the tag first): what tells it from a shared secret."""
CERT_DOMAIN: Final = b"netstorm member certificate v1\x00"
PROOF_DOMAIN: Final = b"netstorm member proof v1\x00"
SERIAL_BYTES: Final = 16

Key32 = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]


class Certificate(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """A member's public key bound to its identity by the authority's signature."""

    identity: Identity
    key: Key32
    serial: Annotated[bytes, msgspec.Meta(min_length=SERIAL_BYTES, max_length=SERIAL_BYTES)]
    signature: Annotated[bytes, msgspec.Meta(min_length=64, max_length=64)] = b""

    def body(self) -> bytes:
        """What the authority signs."""
        return CERT_DOMAIN + _PACK.encode([self.identity, self.key, self.serial])

    def encode(self) -> bytes:
        return _PACK.encode(self)


class MemberFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind", tag=MEMBER_KIND):
    identity: Identity
    key: Key32
    """The member's private Ed25519 key (its 32-byte seed)."""
    certificate: Certificate
    authority: Key32
    """The authority's public key: every certificate a member meets must be signed by it."""


class AuthorityFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind", tag=AUTHORITY_KIND):
    key: Key32
    """The authority's private Ed25519 key (its 32-byte seed)."""


_PACK = msgspec.msgpack.Encoder()
_CERTIFICATE = msgspec.msgpack.Decoder(Certificate)


def _private(seed: bytes) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(seed)


def _public_bytes(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _seed(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())


def parse_identity(text: str) -> Identity:
    """``node:3``, ``trainer:2`` (or ``trainer``), ``admin``, ``scheduler``."""
    role_text, _, number = text.partition(":")
    try:
        role = Role(role_text)
        node_id = int(number) if number else 0
    except ValueError:
        raise ConfigError(f"identity {text!r}: expected node:ID, trainer[:ID], admin or scheduler") from None
    if role is Role.NODE and not number:
        raise ConfigError(f"identity {text!r}: a node's identity names its id (node:ID)")
    if role in (Role.ADMIN, Role.SCHEDULER) and number:
        raise ConfigError(f"identity {text!r}: the {role.value} has no id")
    if not 0 <= node_id < 2**31:
        raise ConfigError(f"identity {text!r}: id out of range")
    return Identity(role, node_id)


def new_authority() -> AuthorityFile:
    return AuthorityFile(key=_seed(Ed25519PrivateKey.generate()))


def issue(authority: AuthorityFile, identity: Identity) -> MemberFile:
    """A new member file for ``identity``: a fresh key pair and a certificate with a fresh serial."""
    member = Ed25519PrivateKey.generate()
    unsigned = Certificate(identity, _public_bytes(member), os.urandom(SERIAL_BYTES))
    signer = _private(authority.key)
    certificate = msgspec.structs.replace(unsigned, signature=signer.sign(unsigned.body()))
    return MemberFile(identity=identity, key=_seed(member), certificate=certificate,
                      authority=_public_bytes(signer))


def is_member_file(data: bytes) -> bool:
    return data.startswith(MEMBER_MARK)


def load_member(path: str | os.PathLike[str]) -> MemberFile:
    return _load(path, MemberFile, "member file")


def load_authority(path: str | os.PathLike[str]) -> AuthorityFile:
    return _load(path, AuthorityFile, "authority file")


def _load(path: str | os.PathLike[str], kind: type[MemberFile] | type[AuthorityFile], what: str):  # type: ignore[no-untyped-def]
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {os.fspath(path)}: {exc.strerror or exc}") from None
    try:
        return msgspec.json.decode(data, type=kind)
    except DECODE_ERRORS as exc:
        raise ConfigError(f"{what} {os.fspath(path)} is not a netstorm {what}: {exc}") from None


def serial_of(text: str) -> bytes:
    """A serial as ``netstorm secret --revoke`` takes it: hex, or the path of the member file."""
    if Path(text).is_file():
        return load_member(text).certificate.serial
    try:
        serial = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"--revoke {text!r}: neither a member file nor a hex serial") from None
    if len(serial) != SERIAL_BYTES:
        raise ConfigError(f"--revoke {text!r}: a serial is {SERIAL_BYTES} bytes ({2 * SERIAL_BYTES} hex digits)")
    return serial


class Revocations:
    """The job's revocation list: one hex serial per line (``#`` starts a comment), read again whenever
    the file changes, so a member revoked while the job runs is refused at its next handshake."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path else None
        self._stamp: tuple[int, int] | None = None
        self._serials: frozenset[bytes] = frozenset()
        self._lock = threading.Lock()
        if self.path is not None and not self.path.is_file():
            raise ConfigError(f"revoked_file {self.path} does not exist (write an empty one, or revoke a member "
                              f"with `netstorm secret {self.path} --revoke MEMBER_FILE`)")
        self.serials()

    def serials(self) -> frozenset[bytes]:
        if self.path is None:
            return self._serials
        with self._lock:
            try:
                info = self.path.stat()
                stamp = (info.st_mtime_ns, info.st_size)
                if stamp != self._stamp:
                    lines = self.path.read_text().splitlines()
                    self._serials = frozenset(bytes.fromhex(line.split("#", 1)[0].strip()) for line in lines
                                              if line.split("#", 1)[0].strip())
                    self._stamp = stamp
            except (OSError, ValueError):
                pass  # keep the list last read: a half-written file must not un-revoke anyone
            return self._serials


class MemberKeys(Keys):
    """A member's own key: it proves ``identity`` only, and checks others' certificates."""

    def __init__(self, member: MemberFile, revocations: Revocations | None = None) -> None:
        self.member = member
        self.identity = member.identity
        self.certificate = member.certificate.encode()
        self._key = _private(member.key)
        self._authority = Ed25519PublicKey.from_public_bytes(member.authority)
        self.revocations = revocations or Revocations(None)
        self._seen: dict[Identity, bytes] = {}
        """The serial each identity last proved itself with (what ``revoked`` checks)."""

    def prove(self, transcript: bytes) -> bytes:
        return self._key.sign(PROOF_DOMAIN + transcript)

    def verify(self, claimed: Identity, transcript: bytes, proof: bytes, certificate: bytes) -> str | None:
        if not certificate:
            return "it proves the shared job secret and this side holds a member key"
        try:
            cert = _CERTIFICATE.decode(certificate)
        except DECODE_ERRORS as exc:
            return f"its certificate does not decode: {exc}"
        try:
            self._authority.verify(cert.signature, cert.body())
        except InvalidSignature:
            return "its certificate is not signed by this job's authority"
        if cert.identity != claimed:
            return f"its certificate is {cert.identity}'s, not {claimed}'s"
        if cert.serial in self.revocations.serials():
            return f"{claimed}'s certificate {cert.serial.hex()} is revoked"
        try:
            Ed25519PublicKey.from_public_bytes(cert.key).verify(proof, PROOF_DOMAIN + transcript)
        except (InvalidSignature, ValueError):
            return f"it does not prove {claimed}'s key"
        self._seen[claimed] = cert.serial
        return None

    def revoked(self, identity: Identity) -> bool:
        """Whether the certificate ``identity`` last proved itself with has been revoked since."""
        serial = self._seen.get(identity)
        return serial is not None and serial in self.revocations.serials()
