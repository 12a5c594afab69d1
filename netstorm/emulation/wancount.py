"""The emulated WAN links' own byte counters, to check the bytes the nodes say they sent.

Every overlay veth end's egress carries one direction of one scenario link, so the sum of their
kernel ``tx_bytes`` over a run is what crossed the WAN: the nodes' chunk frames plus TCP/IP headers,
ACKs, connection set-up, and a frame counted once per physical link it crosses when a tree edge is
routed over several. The runner reads it before and after each system and records it beside the sum
of the nodes' ``wan_bytes``.
"""

from __future__ import annotations

import json
from collections import defaultdict

from netstorm.emulation import netns
from netstorm.emulation.topology import Plan


def overlay_tx_bytes(plan: Plan) -> int:
    """Bytes sent so far on every overlay link end of ``plan`` (the kernel's 64-bit counters)."""
    by_namespace: dict[str, set[str]] = defaultdict(set)
    for iface in plan.interfaces.values():
        by_namespace[iface.namespace].add(iface.name)
    total = 0
    for namespace, names in sorted(by_namespace.items()):
        out = netns.run(["ip", "-n", namespace, "-j", "-s", "link", "show"],
                        what=f"read the link counters of {namespace}")
        for link in json.loads(out or "[]"):
            if link.get("ifname") in names:
                total += int(link["stats64"]["tx"]["bytes"])
    return total
