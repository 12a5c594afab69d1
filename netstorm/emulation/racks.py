"""Racks in an emulated LAN: a bridge per rack, joined to the DC's bridge by a veth shaped both ways to the
rack's uplink.

See docs/ARCHITECTURE.md, *Emulation and results*."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from netstorm.emulation import shaping
from netstorm.emulation.errors import EmulationError


@dataclasses.dataclass(frozen=True)
class RackLink:
    """One emulated rack: its bridge and the veth pair joining it to the DC's bridge."""

    rack: int
    """The description's rack id."""
    bridge: str
    rack_end: str
    """On the rack's bridge; its egress is the rack's uplink (rack -> DC)."""
    dc_end: str
    """On the DC's bridge; its egress is the rack's downlink (DC -> rack)."""
    workers: tuple[int, ...]
    gbit: float
    """Each direction's shaped rate: the rack's ``uplink_gbit`` x the LAN rate scale."""


def rack_links(racks: Sequence[tuple[int, float]], worker_racks: Sequence[int | None], *,
               name: Callable[[str, int], str], scale: float = 1.0) -> tuple[RackLink, ...]:
    """The racks ``(id, uplink_gbit)`` that hold at least one worker of ``worker_racks`` (each worker's
    rack id, or None), in the order given; ``name(kind, k)`` names the k-th rack's devices (``kind`` is
    ``r`` for its bridge, ``ru``/``rd`` for the veth ends on the rack's and the DC's bridge)."""
    if not scale > 0:
        raise EmulationError(f"the LAN rate scale must be positive, got {scale}")
    known = {rid for rid, _ in racks}
    if len(known) != len(racks):
        raise EmulationError(f"duplicate rack ids in {[rid for rid, _ in racks]}")
    stray = sorted({r for r in worker_racks if r is not None and r not in known})
    if stray:
        raise EmulationError(f"workers in racks {stray} that the LAN does not describe (racks: {sorted(known)})")
    out: list[RackLink] = []
    for rid, uplink in racks:
        members = tuple(i for i, r in enumerate(worker_racks) if r == rid)
        if not members:
            continue
        if not uplink > 0:
            raise EmulationError(f"rack {rid}: its uplink must be positive, got {uplink} Gbit/s")
        k = len(out)
        out.append(RackLink(rid, name("r", k), name("ru", k), name("rd", k), members, uplink * scale))
    return tuple(out)


def rack_of(links: Sequence[RackLink], worker: int) -> RackLink | None:
    """The rack ``worker`` sits in, or None (it sits on the DC's bridge)."""
    return next((link for link in links if worker in link.workers), None)


def build_lines(links: Sequence[RackLink], dc_bridge: str, *, mtu: int | None = None) -> list[str]:
    """ip batch lines (in the bridge namespace) that create every rack's bridge and join it to
    ``dc_bridge``; the workers' ports are enslaved to their rack's bridge by the caller."""
    lines: list[str] = []
    for link in links:
        lines += [f"link add {link.bridge} type bridge", f"link set {link.bridge} up",
                  f"link add {link.rack_end} type veth peer name {link.dc_end}",
                  f"link set {link.rack_end} master {link.bridge} up",
                  f"link set {link.dc_end} master {dc_bridge} up",
                  f"link set dev {link.rack_end} type bridge_slave mcast_router 2",
                  f"link set dev {link.dc_end} type bridge_slave mcast_router 2"]
        if mtu is not None and mtu != 1500:
            lines += [f"link set {dev} mtu {mtu}" for dev in (link.bridge, link.rack_end, link.dc_end)]
    return lines


def shape_lines(links: Sequence[RackLink]) -> list[str]:
    """tc batch lines (in the bridge namespace) shaping both directions of every rack link."""
    return [line for link in links for end in (link.rack_end, link.dc_end)
            for line in shaping.lan_port_lines(end, link.gbit)]


def record(namespace: str, links: Sequence[RackLink]) -> list[dict[str, Any]]:
    """Each emulated rack for a result file: its workers, the rate it was shaped to and the rates the
    kernel enforces on its uplink (rack -> DC) and downlink (DC -> rack), read back from tc."""
    out = []
    for link in links:
        up = shaping.read_classes(namespace, link.rack_end)
        down = shaping.read_classes(namespace, link.dc_end)
        out.append({"rack": link.rack, "workers": list(link.workers), "uplink_gbit": round(link.gbit, 6),
                    "kernel_uplink_gbit": round(up["1:1"].rate_bit / 1e9, 6) if "1:1" in up else None,
                    "kernel_downlink_gbit": round(down["1:1"].rate_bit / 1e9, 6) if "1:1" in down else None})
    return out


def drops(namespace: str, links: Sequence[RackLink]) -> dict[str, dict[str, int]]:
    """Packets each rack link's queues dropped, per direction, keyed by rack id."""
    return {str(link.rack): {"up": shaping.qdisc_drops(namespace, link.rack_end),
                             "down": shaping.qdisc_drops(namespace, link.dc_end)} for link in links}
