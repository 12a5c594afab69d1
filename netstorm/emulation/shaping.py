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

import dataclasses
import re
from typing import Any

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


# LAN ports -------------------------------------------------------------------------------------------
#
# A LAN worker's rates are shaped with the same HTB tree as a WAN direction (link class, ACK class, data
# class). Its downlink is the egress of the bridge port toward it (everything the bridge forwards to it,
# whoever sent it, including frames another port's XDP program redirected). Its uplink, by
# ``UPLINK_MODES``:
# - ``veth`` (default): the egress of the worker's own veth end, which carries everything its sockets
#   send; no extra device, no extra hop. What an XDP program on that interface transmits (XDP_TX,
#   redirects: a two-level aggregator forwarding its cluster's partial sums) skips that qdisc, as XDP
#   output skips every qdisc.
# - ``ifb``: the bridge port's ingress redirected (u32 match-all, mirred) to an ifb device whose egress
#   is shaped; it sees every frame the worker emits, XDP's included, for one more device hop per frame.
# This kernel has HTB, TBF, ifb and mirred, but no ``police`` action and no netem.

UPLINK_MODES = ("veth", "ifb")

LAN_BURST_S = 0.001
"""HTB bucket depth of a LAN class, in seconds at its rate. At Gbit/s rates tc's default bucket is a few
hundred bytes, so the class could send only one packet per timer wake-up and would run far below its rate;
a millisecond's worth lets it send back-to-back packets between wake-ups."""
LAN_MIN_BURST = 2 * 65536
"""Smallest LAN bucket in bytes: two of the largest (GSO) packets a socket hands a veth."""
LAN_QUANTUM = 60000
"""Bytes a LAN class sends per round when its classes share the link (HTB warns above 200000, and r2q's
rate/10 would pass that at Gbit/s rates)."""


def lan_burst(gbit: float) -> int:
    """HTB burst in bytes for a LAN class at ``gbit``."""
    return max(LAN_MIN_BURST, round(gbit * 1e9 / 8 * LAN_BURST_S))


def lan_port_lines(device: str, gbit: float) -> list[str]:
    """tc batch lines that shape ``device``'s egress to ``gbit`` Gbit/s (a LAN port), pure ACKs first."""
    if gbit <= 0:
        raise EmulationError(f"a LAN rate must be positive, got {gbit} Gbit/s")
    rate = kbit(gbit * 1000)
    ack = max(8, round(rate * ACK_SHARE))
    burst = lan_burst(gbit)
    opts = f"burst {burst} cburst {burst} quantum {LAN_QUANTUM}"
    return [
        f"qdisc add dev {device} root handle 1: htb default 20",
        f"class add dev {device} parent 1: classid 1:1 htb rate {rate}kbit ceil {rate}kbit {opts}",
        f"class add dev {device} parent 1:1 classid 1:10 htb rate {ack}kbit ceil {rate}kbit {opts} prio 0",
        f"class add dev {device} parent 1:1 classid 1:20 htb rate {max(8, rate - ack)}kbit ceil {rate}kbit "
        f"{opts} prio 1",
        f"filter add dev {device} parent 1: protocol ip prio 1 u32 {ACK_FILTER} flowid 1:10",
    ]


IFB_QUEUE = 1000
"""Packets an ifb uplink device queues (its HTB leaves' limit): a veth's default, so a worker's uplink
queues as much in ``ifb`` mode as in ``veth`` mode. An ifb's own default is 32, which a cluster
aggregator's XDP-forwarded partial sums (no socket, so no back-pressure) overflowed at once."""


def ifb_device_lines(ifb: str) -> list[str]:
    """ip batch lines that create the ifb device ``ifb`` of a worker's uplink, queueing ``IFB_QUEUE``."""
    return [f"link add {ifb} txqueuelen {IFB_QUEUE} type ifb", f"link set {ifb} up"]


def ifb_uplink_lines(port: str, ifb: str) -> list[str]:
    """tc batch lines sending every frame arriving on bridge port ``port`` (the worker's uplink) through
    ``ifb``'s egress first (shape ``ifb`` with ``lan_port_lines``)."""
    return [f"qdisc add dev {port} handle ffff: ingress",
            f"filter add dev {port} parent ffff: protocol all prio 1 u32 match u32 0 0 "
            f"action mirred egress redirect dev {ifb}"]


@dataclasses.dataclass(frozen=True)
class HtbClass:
    """One HTB class as the kernel reports it (``tc -s class show``)."""

    classid: str
    parent: str | None
    rate_bit: float
    ceil_bit: float
    burst_bytes: int
    sent_bytes: int
    sent_packets: int


def read_classes(namespace: str, device: str) -> dict[str, HtbClass]:
    """Every HTB class of ``device`` with its rate, ceiling, bucket and counters, read from the kernel.

    Parsed from tc's text: iproute2 6.1 prints HTB classes as text even with ``-j``."""
    out = run(["tc", "-n", namespace, "-s", "class", "show", "dev", device], what=f"read HTB classes of {device}")
    return parse_classes(out)


def parse_classes(text: str) -> dict[str, HtbClass]:
    """``tc -s class show`` output -> classes by id (only HTB classes)."""
    classes: dict[str, HtbClass] = {}
    current: dict[str, Any] | None = None

    def close() -> None:
        if current is not None:
            classes[current["classid"]] = HtbClass(**current)

    for line in text.splitlines():
        head = _HEAD_RE.match(line)
        if head:
            close()
            current = {"classid": head.group(1), "parent": head.group(2), "rate_bit": _bits(line, "rate"),
                       "ceil_bit": _bits(line, "ceil"), "burst_bytes": _bytes(line, "burst"),
                       "sent_bytes": 0, "sent_packets": 0}
            continue
        sent = _SENT_RE.search(line)
        if sent and current is not None:
            current["sent_bytes"], current["sent_packets"] = int(sent.group(1)), int(sent.group(2))
    close()
    return classes


def qdisc_drops(namespace: str, device: str) -> int:
    """Packets ``device``'s root qdisc dropped (HTB counts its leaves' drops there): a shaped port whose
    queue overflowed."""
    out = run(["tc", "-n", namespace, "-s", "qdisc", "show", "dev", device], what=f"read the qdisc of {device}")
    return parse_root_drops(out)


def parse_root_drops(text: str) -> int:
    """``tc -s qdisc show`` output -> the root qdisc's dropped count (0 without a root qdisc)."""
    root = False
    for line in text.splitlines():
        if line.startswith("qdisc "):
            root = " root " in line
        elif root:
            m = _DROPPED_RE.search(line)
            if m:
                return int(m.group(1))
    return 0


_DROPPED_RE = re.compile(r"Sent \d+ bytes \d+ pkt \(dropped (\d+)")
_HEAD_RE = re.compile(r"^class htb (\S+) (?:root|parent (\S+))")
_SENT_RE = re.compile(r"Sent (\d+) bytes (\d+) pkt")
_SIZE_UNITS = {"b": 1, "Kb": 1024, "Mb": 1024 * 1024}


def _bits(line: str, key: str) -> float:
    m = re.search(rf"\b{key} ([0-9.]+)(bit|Kbit|Mbit|Gbit)\b", line)
    if not m:
        raise EmulationError(f"tc printed no {key} in {line.strip()!r}")
    return float(m.group(1)) * _UNITS[m.group(2)] * 1e6


def _bytes(line: str, key: str) -> int:
    m = re.search(rf"\b{key} ([0-9.]+)(b|Kb|Mb)\b", line)
    if not m:
        raise EmulationError(f"tc printed no {key} in {line.strip()!r}")
    return round(float(m.group(1)) * _SIZE_UNITS[m.group(2)])
