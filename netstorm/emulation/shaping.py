"""HTB rate shaping on each veth's egress, one direction each: class 1:1 caps the link at its rate; under
it pure TCP ACKs (1:10, priority 0) go ahead of everything else (1:20, the default class).

Without the ACK class, the ACKs of the opposite direction's flow wait behind up to a send window of
this direction's data in one FIFO, and a link carrying traffic both ways (every tree edge does: partial
sums up, full sums down) ran each direction at 0.6-0.9 of its rate. Real WAN routers do not hold a
direction's ACKs behind the other direction's bulk data for seconds; the ACK class keeps that artefact
out of the emulation. The ACK class is guaranteed ``ACK_SHARE`` of the rate and may borrow up to all of
it; data borrows whatever ACKs leave, so the link's total stays exactly its rate.

``tc`` rates use kbit = 1000 bit/s, so a scenario's Mbit/s maps exactly to ``round(mbit * 1000)kbit``.
Generic segmentation offload is turned off on the shaped ends so HTB meters wire-sized packets rather
than 64 KB super-packets, which keeps the shaped rate within a few per cent at these rates.
"""

from __future__ import annotations

import re

from netstorm.emulation.errors import EmulationError
from netstorm.emulation.netns import run


def kbit(mbit: float) -> int:
    """The tc rate (kbit, 1000 bit/s) for ``mbit`` Mbit/s; at least 8 kbit (HTB's practical floor)."""
    if mbit <= 0:
        raise EmulationError(f"a shaped rate must be positive, got {mbit} Mbit/s")
    return max(8, round(mbit * 1000))


ACK_SHARE = 0.05
"""Share of a link's rate guaranteed to pure ACKs; unused, it goes to data."""
ACK_FILTER = ("match ip protocol 6 0xff"  # TCP
              " match u8 0x05 0x0f at 0"  # IPv4 header without options
              " match u16 0x0000 0xffc0 at 2"  # total length below 64 bytes: no payload
              " match u8 0x10 0xff at 33")  # TCP flags: ACK alone
GSO_MAX_SIZE = 1500
"""Shaped ends send wire-sized packets (``ip link set DEV gso_max_size``), so HTB meters what the link
would carry."""
LEAVES = ("1:10", "1:20")
"""The ACK class and the data (default) class, both under the link's class 1:1."""


def _class_lines(verb: str, device: str, mbit: float) -> list[str]:
    rate = kbit(mbit)
    ack = max(8, round(rate * ACK_SHARE))
    return [
        f"class {verb} dev {device} parent 1: classid 1:1 htb rate {rate}kbit ceil {rate}kbit",
        f"class {verb} dev {device} parent 1:1 classid 1:10 htb rate {ack}kbit ceil {rate}kbit prio 0",
        f"class {verb} dev {device} parent 1:1 classid 1:20 htb rate {max(8, rate - ack)}kbit ceil {rate}kbit "
        f"prio 1",
    ]


def setup_lines(device: str, mbit: float) -> list[str]:
    """tc batch lines that shape ``device``'s egress to ``mbit``, pure ACKs first."""
    return [
        f"qdisc add dev {device} root handle 1: htb default 20",
        *_class_lines("add", device, mbit),
        f"filter add dev {device} parent 1: protocol ip prio 1 u32 {ACK_FILTER} flowid 1:10",
    ]


def change_lines(device: str, mbit: float) -> list[str]:
    """tc batch lines that re-shape ``device`` in place (queued packets stay queued)."""
    return _class_lines("change", device, mbit)


def netem_lines(device: str, latency_ms: float, loss: float) -> list[str]:
    """tc batch lines adding netem (one-way delay, loss probability) under both of ``device``'s leaves."""
    limit = 100_000  # packets: netem's default 1000 would drop at delay x rate beyond ~1.5 MB in flight
    return [f"qdisc add dev {device} parent {leaf} handle {leaf[2:]}: netem limit {limit} "
            f"delay {latency_ms:g}ms loss {loss * 100:g}%" for leaf in LEAVES]


def read_rate_mbit(namespace: str, device: str) -> float:
    """The rate HTB currently enforces on ``device`` (read back from the kernel), in Mbit/s."""
    out = run(["tc", "-n", namespace, "class", "show", "dev", device], what=f"read HTB class of {device}")
    for line in out.splitlines():
        m = _CLASS_RE.search(line)
        if m:
            return float(m.group(1)) * _UNITS[m.group(2)]
    raise EmulationError(f"{device} in {namespace} has no HTB class 1:1 (tc said: {out.strip()[:200]!r})")


_CLASS_RE = re.compile(r"class htb 1:1 .*?\brate ([0-9.]+)(bit|Kbit|Mbit|Gbit)\b")
_UNITS = {"bit": 1e-6, "Kbit": 1e-3, "Mbit": 1.0, "Gbit": 1e3}
