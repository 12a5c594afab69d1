"""HTB rate shaping: one root HTB with a single class on each veth's egress, one direction each.

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


def setup_lines(device: str, mbit: float) -> list[str]:
    """tc batch lines that shape ``device``'s egress to ``mbit``."""
    rate = kbit(mbit)
    return [
        f"qdisc add dev {device} root handle 1: htb default 1",
        f"class add dev {device} parent 1: classid 1:1 htb rate {rate}kbit ceil {rate}kbit",
    ]


def change_line(device: str, mbit: float) -> str:
    """A tc batch line that re-shapes ``device`` in place (queued packets stay queued)."""
    rate = kbit(mbit)
    return f"class change dev {device} parent 1: classid 1:1 htb rate {rate}kbit ceil {rate}kbit"


def netem_line(device: str, latency_ms: float, loss: float) -> str:
    """A tc batch line adding netem (one-way delay, loss probability) under ``device``'s HTB class."""
    limit = 100_000  # packets: netem's default 1000 would drop at delay x rate beyond ~1.5 MB in flight
    return (f"qdisc add dev {device} parent 1:1 handle 10: netem limit {limit} delay {latency_ms:g}ms "
            f"loss {loss * 100:g}%")


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
