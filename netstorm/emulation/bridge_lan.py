"""A LAN in network namespaces: one gateway and N workers on a bridge, for the edge tier's tests and
benchmark.

Every namespace name carries a per-run prefix (pid and a counter), every interface lives inside those
namespaces (nothing is created in the caller's namespace), and ``close`` deletes them all, also after a
failure. Sockets are opened *inside* a namespace from a short-lived thread that enters it
(``netns.run_in``), so one process and one event loop can drive the gateway and all workers.

With ``rates`` every worker's port is shaped with HTB (``shaping.lan_port_lines``): its downlink on the
bridge port toward it, its uplink on its own veth end (``uplink="veth"``) or on an ifb device its bridge
port's ingress is redirected to (``uplink="ifb"``: XDP-transmitted frames included, see ``shaping``);
``gateway_gbit`` shapes the gateway's port the same way. ``rate_scale`` multiplies every rate, for rates
above what the host's veth bridge can move (the emulation's ``lan_bw_scale``).

With ``racks`` (``(id, uplink_gbit)`` each) and ``worker_racks`` (each worker's rack id, or None) the
workers of a rack sit on their own bridge joined to the DC's by a link shaped both ways to the rack's
uplink (``racks.py``), in the same bridge namespace.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from netstorm.emulation import netns, shaping
from netstorm.emulation import racks as racks_mod
from netstorm.emulation.errors import EmulationError
from netstorm.lan import udp

OWNED = re.compile(r"ns(\d+)x\d+")
"""A LAN's namespaces are named for the process that made them (``ns<pid>x<n>...``)."""


def sweep_dead() -> list[str]:
    """Delete the namespaces of LANs whose process is gone (killed before it could remove them), as every
    new LAN does first, so that nothing outlives its process for longer than the next LAN's start."""
    removed = []
    for name in netns.list_namespaces():
        owner = OWNED.match(name)
        if owner is not None and netns.process_start_time(int(owner.group(1))) is None:
            with contextlib.suppress(EmulationError):
                netns.delete_namespace(name)
                removed.append(name)
    return removed


SUBNET = "10.77.0"
GATEWAY_IP = f"{SUBNET}.1"
GATEWAY_PORT = "g"
"""The bridge's end of the gateway's veth pair (in the bridge's namespace)."""
_runs = itertools.count()
BRIDGE_SYSCTLS = {"net.bridge.bridge-nf-call-iptables": "0", "net.bridge.bridge-nf-call-ip6tables": "0",
                  "net.bridge.bridge-nf-call-arptables": "0"}
"""With br_netfilter loaded (as on this host) every bridged frame also runs the IP netfilter hooks and
their route lookups; a LAN switch does neither, and nothing filters in the bridge's namespace."""


def quiet_bridge(namespace: str) -> None:
    """Turn off the netfilter hooks for frames bridged in ``namespace`` (nothing to do without
    br_netfilter, whose keys then do not exist)."""
    if Path("/proc/sys/net/bridge").exists():
        netns.sysctl(namespace, BRIDGE_SYSCTLS)


class Lan:
    """Gateway ``<prefix>g`` (eth0, 10.77.0.1) and workers ``<prefix>w<i>`` (eth0, 10.77.0.10+i) on a
    bridge in ``<prefix>b``. The gateway's veth pair has ``queues`` receive/transmit queues; every link has
    the IPv4 ``mtu``."""

    def __init__(self, workers: int, *, queues: int = 2, mtu: int = 1500,
                 rates: Sequence[tuple[float, float]] | None = None, gateway_gbit: float | None = None,
                 rate_scale: float = 1.0, uplink: str = "veth", racks: Sequence[tuple[int, float]] = (),
                 worker_racks: Sequence[int | None] = ()) -> None:
        if not 1 <= workers <= 64:
            raise EmulationError(f"a LAN holds 1..64 workers, asked for {workers}")
        if rates is not None and len(rates) != workers:
            raise EmulationError(f"rates for {len(rates)} workers given to a LAN of {workers}")
        if not rate_scale > 0:
            raise EmulationError(f"the LAN rate scale must be positive, got {rate_scale}")
        if uplink not in shaping.UPLINK_MODES:
            raise EmulationError(f"uplink shaping is one of {', '.join(shaping.UPLINK_MODES)}, got {uplink!r}")
        if racks and len(worker_racks) != workers:
            raise EmulationError(f"racks for {len(worker_racks)} workers given to a LAN of {workers}")
        self.uplink = uplink
        self.racks = racks_mod.rack_links(racks, worker_racks, name=lambda kind, k: f"{kind}{k}",
                                          scale=rate_scale) if racks else ()
        """The emulated racks (those holding a worker), their uplinks after ``rate_scale``."""
        self.rate_scale = rate_scale
        self.rates: list[tuple[float, float]] | None = (
            [(up * rate_scale, down * rate_scale) for up, down in rates] if rates is not None else None)
        """Each worker's shaped (uplink, downlink) in Gbit/s, after ``rate_scale``; None when unshaped."""
        self.gateway_gbit = gateway_gbit * rate_scale if gateway_gbit is not None else None
        sweep_dead()
        self.prefix = f"ns{os.getpid()}x{next(_runs)}"
        self.gateway = f"{self.prefix}g"
        self.bridge = f"{self.prefix}b"
        self.workers = [f"{self.prefix}w{i}" for i in range(workers)]
        self._created: list[str] = []
        try:
            for ns in (self.bridge, self.gateway, *self.workers):
                netns.add_namespace(ns)
                self._created.append(ns)
            q = str(queues)
            lines = ["link add br0 type bridge", "link set br0 up",
                     f"link add g numtxqueues {q} numrxqueues {q} type veth peer name eth0 netns {self.gateway} "
                     f"numtxqueues {q} numrxqueues {q}"]
            lines += [f"link add w{i} type veth peer name eth0 netns {ns}" for i, ns in enumerate(self.workers)]
            lines += racks_mod.build_lines(self.racks, "br0", mtu=mtu)
            lines.append("link set g master br0 up")
            lines += [f"link set w{i} master {self.worker_bridge(i)} up" for i in range(workers)]
            if mtu != 1500:
                lines += [f"link set {end} mtu {mtu}" for end in ("br0", "g", *(f"w{i}" for i in range(workers)))]
            netns.ip_batch(lines, namespace=self.bridge, what=f"build the LAN bridge {self.bridge}")
            quiet_bridge(self.bridge)
            for ns, address in ((self.gateway, GATEWAY_IP),
                                *((ns, self.worker_ip(i)) for i, ns in enumerate(self.workers))):
                netns.ip_batch([f"addr add {address}/24 dev eth0", f"link set eth0 mtu {mtu}", "link set eth0 up",
                                "link set lo up"], namespace=ns, what=f"address {ns}")
            self._shape()
        except BaseException:
            self.close()
            raise

    def _shape(self) -> None:
        bridge_lines: list[str] = []
        if self.gateway_gbit is not None:
            bridge_lines += shaping.lan_port_lines("g", self.gateway_gbit)
            netns.tc_batch(shaping.lan_port_lines("eth0", self.gateway_gbit), namespace=self.gateway,
                           what=f"shape the gateway port of {self.gateway}")
        bridge_lines += racks_mod.shape_lines(self.racks)
        for i, (ns, (up, down)) in enumerate(zip(self.workers, self.rates or [], strict=False)):
            bridge_lines += shaping.lan_port_lines(self.bridge_port(i), down)
            if self.uplink == "ifb":
                netns.ip_batch(shaping.ifb_device_lines(self.uplink_ifb(i)),
                               namespace=self.bridge, what=f"uplink device of worker {i}")
                bridge_lines += shaping.ifb_uplink_lines(self.bridge_port(i), self.uplink_ifb(i))
                bridge_lines += shaping.lan_port_lines(self.uplink_ifb(i), up)
            else:
                netns.tc_batch(shaping.lan_port_lines("eth0", up), namespace=ns, what=f"shape the uplink of {ns}")
        netns.tc_batch(bridge_lines, namespace=self.bridge, what=f"shape the LAN ports of {self.bridge}")

    def worker_bridge(self, i: int) -> str:
        """The bridge worker ``i``'s port is on: its rack's, or the DC's ``br0``."""
        rack = racks_mod.rack_of(self.racks, i)
        return rack.bridge if rack is not None else "br0"

    def rack_record(self) -> list[dict[str, Any]]:
        """The emulated racks with their uplinks' rates read back from the kernel (``racks.record``)."""
        return racks_mod.record(self.bridge, self.racks)

    def reshape(self, i: int, up: float, down: float) -> None:
        """Shape worker ``i``'s ports to new rates (Gbit/s, before ``rate_scale``) while the LAN runs: a LAN
        whose links change mid-run (``netstorm bench replan``). Only a LAN made with ``rates``."""
        if self.rates is None:
            raise EmulationError("reshape needs a LAN made with rates (shaped ports)")
        up, down = up * self.rate_scale, down * self.rate_scale
        self.rates[i] = (up, down)
        port = self.bridge_port(i)
        lines = [f"qdisc del dev {port} root", *shaping.lan_port_lines(port, down)]
        ns, device = self.uplink_shaper(i)
        if ns == self.bridge:
            lines += [f"qdisc del dev {device} root", *shaping.lan_port_lines(device, up)]
        else:
            netns.tc_batch([f"qdisc del dev {device} root", *shaping.lan_port_lines(device, up)], namespace=ns,
                           what=f"reshape the uplink of {ns}")
        netns.tc_batch(lines, namespace=self.bridge, what=f"reshape the LAN port of worker {i}")

    def uplink_shaper(self, i: int) -> tuple[str, str]:
        """(namespace, device) whose egress HTB shapes worker ``i``'s uplink."""
        return (self.bridge, self.uplink_ifb(i)) if self.uplink == "ifb" else (self.workers[i], "eth0")

    @staticmethod
    def uplink_ifb(i: int) -> str:
        """The ifb device (in the bridge namespace) of worker ``i``'s uplink in ``ifb`` mode."""
        return f"u{i}"

    @staticmethod
    def bridge_port(i: int) -> str:
        """Worker ``i``'s port on the bridge (in the bridge namespace); its egress is the worker's downlink."""
        return f"w{i}"

    @staticmethod
    def worker_ip(i: int) -> str:
        return f"{SUBNET}.{10 + i}"

    def udp_socket(self, ns: str, host: str, port: int = 0, *, rcvbuf: int = 4 << 20) -> socket.socket:
        """A non-blocking UDP socket bound to (host, port) inside ``ns``."""

        def make() -> socket.socket:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.bind((host, port))
            sock.setblocking(False)
            return sock

        return netns.run_in(ns, make)

    def group_opener(self, ns: str) -> Callable[[tuple[str, int], str], socket.socket]:
        """Opens a LAN worker's multicast group socket inside ``ns`` (netstorm/lan/sender.py's
        ``group_opener``: this process drives every namespace from one thread)."""
        from netstorm.lan.sender import group_socket

        return lambda group, local: netns.run_in(ns, lambda: group_socket(group, local))

    def drops(self) -> dict[str, Any]:
        """Where this LAN lost packets so far: each shaped port's queue (``ports``: the bridge's egress toward
        the gateway ``g`` and each worker ``w<i>``, i.e. their downlinks; ``uplinks``: each worker's own
        egress, or its ifb) and each namespace's UDP receive-buffer overflows (``udp_rcvbuf``, from its
        /proc/net/snmp), named by host (``g``, ``w<i>``)."""
        hosts = {"g": self.gateway, **{f"w{i}": ns for i, ns in enumerate(self.workers)}}
        ports = {end: shaping.qdisc_drops(self.bridge, end) for end in hosts}
        uplinks = {f"w{i}": shaping.qdisc_drops(*self.uplink_shaper(i)) for i in range(len(self.workers))}
        uplinks["g"] = shaping.qdisc_drops(self.gateway, "eth0")
        udp = {name: netns.run_in(ns, _udp_rcvbuf_errors) for name, ns in hosts.items()}
        out: dict[str, Any] = {"ports": ports, "uplinks": uplinks, "udp_rcvbuf": udp}
        if self.racks:
            out["racks"] = racks_mod.drops(self.bridge, self.racks)
        return out

    def gateway_ifindex(self) -> int:
        return netns.run_in(self.gateway, lambda: socket.if_nametoindex("eth0"))

    def gateway_mac(self) -> bytes:
        """The gateway's Ethernet address on the LAN (where results it sends from XDP come from)."""
        return netns.run_in(self.gateway, lambda: udp.interface_mac("eth0"))

    def close(self) -> None:
        for ns in reversed(self._created):
            with contextlib.suppress(EmulationError):  # best effort: the others still go
                netns.delete_namespace(ns)
        self._created.clear()

    def __enter__(self) -> Lan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _udp_rcvbuf_errors() -> int:
    """RcvbufErrors of UDP in the calling thread's namespace."""
    lines = [line.split() for line in Path("/proc/thread-self/net/snmp").read_text().splitlines()
             if line.startswith("Udp:")]
    return int(dict(zip(lines[0], lines[1], strict=True))["RcvbufErrors"])
