"""The LAN datagrams' tokens: bound to sender, job, worker and iteration, never zero with a secret, zero and
unchecked without one, derived into a bounded cache; and where a gateway and a worker find the secret."""

from __future__ import annotations

import hashlib
import hmac
import struct
from pathlib import Path
from types import SimpleNamespace

from netstorm.commands.node import edge_secret
from netstorm.lan import tokens as tokens_mod
from netstorm.lan.tokens import LanTokens, Sender, token

SECRET = b"0123456789abcdef0123456789abcdef"


def test_a_token_is_the_first_eight_bytes_of_the_hmac_over_what_it_names() -> None:
    mac = hmac.digest(SECRET, b"netstorm-lan" + struct.pack("<BHBI", 1, 7, 3, 1000), hashlib.sha256)
    assert token(SECRET, Sender.WORKER, 7, 3, 1000) == int.from_bytes(mac[:8], "little")


def test_tokens_differ_by_sender_job_worker_iteration_and_secret() -> None:
    base = token(SECRET, Sender.WORKER, 1, 1, 5)
    others = [token(SECRET, Sender.GATEWAY, 1, 1, 5), token(SECRET, Sender.WORKER, 2, 1, 5),
              token(SECRET, Sender.WORKER, 1, 2, 5), token(SECRET, Sender.WORKER, 1, 1, 6),
              token(b"another secret of 32 bytes......", Sender.WORKER, 1, 1, 5)]
    assert base not in others and len(set(others)) == len(others)
    assert all(0 < t < 2**64 for t in [base, *others])


def test_without_a_secret_every_token_is_zero_and_anything_is_valid() -> None:
    open_lan = LanTokens(None, 1)
    assert not open_lan.enabled
    assert open_lan.worker(3, 9) == open_lan.gateway(3, 9) == 0
    assert open_lan.valid(Sender.WORKER, 3, 9, 12345)
    keyed = LanTokens(SECRET, 1)
    assert keyed.enabled and keyed.valid(Sender.WORKER, 3, 9, keyed.worker(3, 9))
    assert not keyed.valid(Sender.WORKER, 3, 9, keyed.gateway(3, 9))
    assert not keyed.valid(Sender.WORKER, 3, 9, 0)


def test_the_cache_stays_bounded_and_free_choices_are_not_cached() -> None:
    keyed = LanTokens(SECRET, 1)
    for k in range(tokens_mod.CACHE + 10):
        keyed.worker(0, k)
    assert len(keyed._cache) <= tokens_mod.CACHE
    keyed._cache.clear()
    assert keyed.of(Sender.WORKER, 0, 77, keep=False) == keyed.worker(0, 77)
    assert len(keyed._cache) == 1


def test_the_gateway_reads_the_secret_from_secret_file_when_the_configuration_has_one(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    assert edge_secret(SimpleNamespace(secret_file=str(path))) == SECRET
    assert edge_secret(SimpleNamespace(secret_file=None)) is None
    assert edge_secret(SimpleNamespace()) is None
