"""Keyed tokens that authenticate LAN edge datagrams without cryptography on the data path.

With a job secret, every datagram carries ``token`` = the first 8 bytes of HMAC-SHA256(secret,
"netstorm-lan" | sender | job | worker | iteration), read as a little-endian u64. ``sender`` says who
may send it: a worker (DATA, HELLO, PULL) or the gateway (RESULT, NACK and the HELLO answer, to the worker
named). A receiver compares the token with the value it derives (workers, the gateway's agent) or that
the agent installed in a map beforehand (the XDP program), so the per-packet cost is a lookup and a
compare. Whoever holds the secret can produce any token; whoever does not cannot, and a token names one
worker's one iteration, so a captured token is of no use for another worker or iteration.

Without a secret every token is 0 and nothing is checked: the LAN then trusts any datagram that reaches
the gateway's port, as the edge tier always did.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from typing import Final

LABEL: Final = b"netstorm-lan"
_FIELDS: Final = struct.Struct("<BHBI")
"""sender, job, worker, iteration: what a token is bound to, after LABEL."""
CACHE: Final = 4096
"""Tokens a receiver keeps derived; the cache is cleared when full, so it stays bounded."""


class Sender(enum.IntEnum):
    WORKER = 1
    """DATA, HELLO and PULL, from the worker named in the header."""
    GATEWAY = 2
    """RESULT, NACK and the HELLO answer, to the worker named."""
    GROUP = 3
    """RESULT and ACK sent once to every worker (multicast); worker 0 in the token's fields."""


def token(secret: bytes, sender: Sender, job: int, worker: int, iteration: int) -> int:
    """The token of one (sender, job, worker, iteration): 8 bytes of HMAC-SHA256, never 0."""
    mac = hmac.digest(secret, LABEL + _FIELDS.pack(int(sender), job, worker, iteration & 0xFFFFFFFF), hashlib.sha256)
    return int.from_bytes(mac[:8], "little") or 1


class LanTokens:
    """One job's tokens, derived once and kept in a bounded cache. ``enabled`` is False without a secret;
    every token is then 0 and ``valid`` accepts anything."""

    def __init__(self, secret: bytes | None, job: int) -> None:
        self.secret = secret or None
        self.job = job
        self._cache: dict[tuple[int, int, int], int] = {}

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def of(self, sender: Sender, worker: int, iteration: int, *, keep: bool = True) -> int:
        """The token; ``keep=False`` derives it without caching (for values a sender chose freely, such as
        a HELLO nonce, which would otherwise let anyone fill the cache)."""
        if self.secret is None:
            return 0
        key = (int(sender), worker, iteration & 0xFFFFFFFF)
        found = self._cache.get(key)
        if found is None and not keep:
            return token(self.secret, sender, self.job, worker, iteration)
        if found is None:
            if len(self._cache) >= CACHE:
                self._cache.clear()
            found = self._cache[key] = token(self.secret, sender, self.job, worker, iteration)
        return found

    def worker(self, worker: int, iteration: int) -> int:
        return self.of(Sender.WORKER, worker, iteration)

    def gateway(self, worker: int, iteration: int) -> int:
        return self.of(Sender.GATEWAY, worker, iteration)

    def group(self, iteration: int) -> int:
        return self.of(Sender.GROUP, 0, iteration)

    def valid(self, sender: Sender, worker: int, iteration: int, value: int, *, keep: bool = True) -> bool:
        """Whether ``value`` is the token of (sender, worker, iteration); always True without a secret."""
        return self.secret is None or hmac.compare_digest(
            self.of(sender, worker, iteration, keep=keep).to_bytes(8, "little"), value.to_bytes(8, "little"))
