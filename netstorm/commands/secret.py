"""``netstorm secret FILE``: write a new job secret (and, with ``--tls``, the job certificate and key).

The secret is ``SECRET_BYTES`` random bytes from the operating system, written with mode 0600 to a file
that must not exist yet (``--force`` replaces it): every process of the job is then started with
``--secret-file FILE`` (or ``NETSTORM_SECRET_FILE``), and the file is copied to each host the way any
other credential is. ``--tls`` also writes FILE.crt and FILE.key, a self-signed certificate (ECDSA P-256)
made with the ``openssl`` command, which every process of the job pins when ``wan_tls`` is on.

Per-member credentials (``netstorm.memberkeys``) instead of one shared secret: ``--new-authority``
writes the job's authority to FILE (keep it where credentials are issued, not on the job's hosts);
``--issue IDENTITY --authority AUTH`` writes IDENTITY's member file (``node:3``, ``trainer:2``,
``admin``, ``scheduler``) to FILE, for that process's ``member_file`` (a trainer's ``secret_file``);
``--revoke MEMBER`` appends a member's serial (its file, or the serial printed when it was issued) to
the revocation list FILE, which the scheduler and nodes read as ``revoked_file``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from pathlib import Path

import msgspec

from netstorm.authconn import tls_files
from netstorm.errors import ConfigError

NAME = "secret"
HELP = ("write a new random job secret to FILE (mode 0600); --tls also writes the job certificate and key; "
        "--new-authority, --issue and --revoke manage per-member keys")
SECRET_BYTES = 64
CERT_DAYS = 3650


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="where to write the secret (must not exist unless --force)")
    parser.add_argument("--force", action="store_true", help="replace FILE (and its .crt/.key with --tls)")
    parser.add_argument("--tls", action="store_true",
                        help="also write FILE.crt and FILE.key: the self-signed job certificate wan_tls pins")
    members = parser.add_mutually_exclusive_group()
    members.add_argument("--new-authority", action="store_true",
                         help="write a new job authority to FILE: it signs every member's certificate")
    members.add_argument("--issue", metavar="IDENTITY",
                         help="write IDENTITY's member file to FILE (node:ID, trainer[:ID], admin, scheduler), "
                              "signed by --authority")
    members.add_argument("--revoke", metavar="MEMBER",
                         help="append MEMBER (a member file, or its hex serial) to the revocation list FILE")
    parser.add_argument("--authority", metavar="AUTH", help="the authority file that --issue signs with")


def _create(path: Path, data: bytes, force: bool) -> None:
    """Write ``data`` to ``path`` readable by its owner only; never through an existing file's mode."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    if force:
        path.unlink(missing_ok=True)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path} exists; pass --force to replace it (every process of the job then needs the "
                          "new one)") from None
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror}") from None
    with os.fdopen(fd, "wb") as file:
        os.fchmod(file.fileno(), 0o600)
        file.write(data)


def write_certificate(secret_file: str | os.PathLike[str], force: bool) -> tuple[Path, Path]:
    """The job certificate and its key beside ``secret_file``, made by ``openssl``."""
    certificate, key = tls_files(secret_file)
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ConfigError("--tls needs the openssl command")
    for path in (certificate, key):
        if path.exists() and not force:
            raise ConfigError(f"{path} exists; pass --force to replace it")
        path.unlink(missing_ok=True)
    _create(key, b"", force=True)  # 0600 before the key is in it
    command = [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
               "-keyout", str(key), "-out", str(certificate), "-days", str(CERT_DAYS), "-subj", "/CN=netstorm-job",
               "-addext", "basicConstraints=critical,CA:TRUE"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ConfigError(f"openssl could not make the job certificate: {done.stderr.strip()}")
    os.chmod(key, 0o600)
    return certificate, key


def _members(args: argparse.Namespace, path: Path) -> int:
    from netstorm import memberkeys  # only here: the shared-secret path needs no key library

    if args.new_authority:
        _create(path, msgspec.json.encode(memberkeys.new_authority()), args.force)
        print(f"wrote a new job authority to {path} (mode 0600); issue each member's key with "
              f"`netstorm secret FILE --issue node:ID --authority {path}`")
        return 0
    if args.issue:
        if not args.authority:
            raise ConfigError("--issue needs --authority AUTH (write one with --new-authority)")
        identity = memberkeys.parse_identity(args.issue)
        member = memberkeys.issue(memberkeys.load_authority(args.authority), identity)
        _create(path, msgspec.json.encode(member), args.force)
        print(f"wrote {identity}'s member key to {path} (mode 0600), serial {member.certificate.serial.hex()}; "
              f"start that process with --member-file {path}")
        return 0
    serial = memberkeys.serial_of(args.revoke)
    with open(path, "a", encoding="ascii") as file:
        file.write(serial.hex() + "\n")
    print(f"revoked {serial.hex()} in {path}: it is refused from its next handshake on")
    return 0


def run(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if args.new_authority or args.issue or args.revoke:
        return _members(args, path)
    _create(path, os.urandom(SECRET_BYTES), args.force)
    print(f"wrote a {SECRET_BYTES}-byte job secret to {path} (mode 0600); start every process of the job with "
          f"--secret-file {path}")
    if args.tls:
        certificate, key = write_certificate(path, args.force)
        print(f"wrote the job certificate {certificate} and its key {key}; --wan-tls true encrypts with them")
    return 0
