"""The emulated network's plan: namespace and interface names, addresses and routes (no I/O).

See docs/ARCHITECTURE.md, *Emulation and results*."""

from __future__ import annotations

import dataclasses
import ipaddress
import re

from netstorm.emulation.errors import EmulationError
from netstorm.emulation.racks import RackLink, rack_links
from netstorm.lan_scenario import LanSpec
from netstorm.routing import shortest_hop_routes
from netstorm.scenario import Scenario

NAMESPACE_PREFIX = "nse"
"""Every namespace this emulator creates is named ``nse<run>-...``."""
IFNAME_PREFIX = "n"
RUN_ID_RE = re.compile(r"^[0-9a-f]{4}$")
MAX_DCS = 250
MAX_NODE_ID = 999
IFNAMSIZ = 15
MGMT_HOST = "10.102.0.1"
MAX_LAN_WORKERS = 64
"""The edge wire's worker bitmap holds 64 workers per gateway."""


@dataclasses.dataclass(frozen=True)
class Interface:
    """One end of a veth pair inside a DC namespace; its egress carries traffic ``src -> dst``."""

    name: str
    namespace: str
    address: str
    """With prefix length, e.g. ``10.101.0.1/30``."""
    src: int
    dst: int
    peer_address: str
    """The other end's address without prefix: the next hop for routes through this interface."""


@dataclasses.dataclass(frozen=True)
class Route:
    namespace: str
    destination: str
    """``A.B.C.D/32``"""
    via: str
    device: str
    source: str


@dataclasses.dataclass(frozen=True)
class MgmtPort:
    dc: int
    dc_end: str
    bridge_end: str
    address: str
    """With prefix length, on ``dc_end`` inside the DC namespace."""


@dataclasses.dataclass(frozen=True)
class LanPlan:
    """One DC's LAN: a bridge namespace, the gateway-facing interface in the DC namespace, the workers."""

    dc: int
    bridge_namespace: str
    bridge: str
    gateway_iface: str
    """In the DC namespace; the XDP aggregator attaches here."""
    gateway_bridge_end: str
    gateway_address: str
    """Without prefix length (the LAN is a /24)."""
    worker_namespaces: tuple[str, ...]
    worker_ifaces: tuple[str, ...]
    """Inside each worker's namespace."""
    worker_bridge_ends: tuple[str, ...]
    worker_addresses: tuple[str, ...]
    rates: tuple[tuple[float, float], ...] = ()
    """Each worker's (uplink, downlink) in Gbit/s from the scenario, unscaled; empty: the LAN is unshaped."""
    gateway_gbit: float | None = None
    """The gateway's port rate per direction, when the scenario describes the LAN."""
    worker_uplink_ifbs: tuple[str, ...] = ()
    """In the bridge namespace: the ifb device of each worker's uplink (``lan_uplink_shaping = "ifb"``)."""
    racks: tuple[RackLink, ...] = ()
    """The described racks that hold a worker, their bridges and links in the bridge namespace; ``gbit`` is
    the rack's uplink from the scenario, unscaled."""

    def worker_bridge(self, i: int) -> str:
        """The bridge worker ``i``'s port is on: its rack's, or the DC's."""
        return next((r.bridge for r in self.racks if i in r.workers), self.bridge)

    @property
    def namespaces(self) -> list[str]:
        return [self.bridge_namespace, *self.worker_namespaces]

    @property
    def workers(self) -> int:
        return len(self.worker_namespaces)


@dataclasses.dataclass(frozen=True)
class Plan:
    run_id: str
    node_ids: tuple[int, ...]
    namespaces: dict[int, str]
    node_addresses: dict[int, str]
    interfaces: dict[tuple[int, int], Interface]
    """Keyed by the direction its egress shapes."""
    routes: tuple[Route, ...]
    paths: dict[tuple[int, int], tuple[int, ...]]
    mgmt_namespace: str
    bridge: str
    mgmt_ports: dict[int, MgmtPort]
    lans: dict[int, LanPlan] = dataclasses.field(default_factory=dict)
    """Keyed by DC, only for DCs with LAN workers."""

    @property
    def all_namespaces(self) -> list[str]:
        return [self.mgmt_namespace, *self.namespaces.values(),
                *(ns for lan in self.lans.values() for ns in lan.namespaces)]

    def mgmt_address(self, dc: int) -> str:
        return self.mgmt_ports[dc].address.split("/")[0]


def namespace_name(run_id: str, suffix: str) -> str:
    name = f"{NAMESPACE_PREFIX}{run_id}-{suffix}"
    if len(name) > IFNAMSIZ:
        raise EmulationError(f"namespace name {name!r} is longer than {IFNAMSIZ} characters")
    return name


def run_of_namespace(name: str) -> str | None:
    """The run id a namespace name belongs to, or None when this emulator did not name it."""
    m = re.match(rf"^{NAMESPACE_PREFIX}([0-9a-f]{{4}})-", name)
    return m.group(1) if m else None


def _ifname(run_id: str, tail: str) -> str:
    name = f"{IFNAME_PREFIX}{run_id}-{tail}"
    if len(name) > IFNAMSIZ:
        raise EmulationError(f"interface name {name!r} is longer than {IFNAMSIZ} characters")
    return name


def _link_addresses(index: int) -> tuple[str, str]:
    base = ipaddress.IPv4Address("10.101.0.0") + 4 * index
    if base > ipaddress.IPv4Address("10.101.255.252"):
        raise EmulationError(f"too many links for 10.101.0.0/16 (link #{index})")
    return str(base + 1), str(base + 2)


def build_plan(scenario: Scenario, run_id: str) -> Plan:
    """Names, addresses and routes for ``scenario`` under ``run_id``; raises on what cannot be emulated."""
    if not RUN_ID_RE.match(run_id):
        raise EmulationError(f"run id must be 4 lowercase hex digits, got {run_id!r}")
    ids = tuple(sorted(scenario.node_ids))
    if len(ids) > MAX_DCS:
        raise EmulationError(f"at most {MAX_DCS} DCs can be emulated, the scenario has {len(ids)}")
    if ids[-1] > MAX_NODE_ID:
        raise EmulationError(f"node ids above {MAX_NODE_ID} do not fit interface names (got {ids[-1]})")
    namespaces = {dc: namespace_name(run_id, str(dc)) for dc in ids}
    node_addresses = {dc: f"10.100.0.{k + 1}" for k, dc in enumerate(ids)}
    interfaces: dict[tuple[int, int], Interface] = {}
    for index, link in enumerate(scenario.links):
        addr_a, addr_b = _link_addresses(index)
        interfaces[(link.a, link.b)] = Interface(
            _ifname(run_id, f"{link.a}-{link.b}"), namespaces[link.a], f"{addr_a}/30", link.a, link.b, addr_b)
        interfaces[(link.b, link.a)] = Interface(
            _ifname(run_id, f"{link.b}-{link.a}"), namespaces[link.b], f"{addr_b}/30", link.b, link.a, addr_a)
    paths = shortest_hop_routes(ids, [(lk.a, lk.b) for lk in scenario.links])
    routes: list[Route] = []
    for (src, dst), path in sorted(paths.items()):
        iface = interfaces[(src, path[1])]
        routes.append(Route(namespaces[src], f"{node_addresses[dst]}/32", iface.peer_address, iface.name,
                            node_addresses[src]))
    mgmt_ports = {
        dc: MgmtPort(dc, _ifname(run_id, f"m{dc}"), _ifname(run_id, f"b{dc}"), f"10.102.0.{k + 2}/24")
        for k, dc in enumerate(ids)
    }
    lans = {dc: _lan_plan(run_id, dc, k, scenario.node(dc).lan_workers, scenario.node(dc).lan)
            for k, dc in enumerate(ids) if scenario.node(dc).lan_workers > 0}
    return Plan(run_id, ids, namespaces, node_addresses, interfaces, tuple(routes), paths,
                namespace_name(run_id, "mgmt"), _ifname(run_id, "br"), mgmt_ports, lans)


def _lan_plan(run_id: str, dc: int, index: int, workers: int, spec: LanSpec | None = None) -> LanPlan:
    if workers > MAX_LAN_WORKERS:
        raise EmulationError(f"DC {dc}: at most {MAX_LAN_WORKERS} LAN workers per gateway, got {workers}")
    if spec is not None and len(spec.workers) != workers:
        raise EmulationError(f"DC {dc}: its LAN describes {len(spec.workers)} workers, {workers} asked for")
    subnet = f"10.103.{index}"
    return LanPlan(
        dc=dc,
        bridge_namespace=namespace_name(run_id, f"{dc}l"),
        bridge=_ifname(run_id, f"l{dc}"),
        gateway_iface=_ifname(run_id, f"g{dc}"),
        gateway_bridge_end=_ifname(run_id, f"h{dc}"),
        gateway_address=f"{subnet}.1",
        worker_namespaces=tuple(namespace_name(run_id, f"{dc}w{i}") for i in range(workers)),
        worker_ifaces=tuple(_ifname(run_id, f"w{dc}-{i}") for i in range(workers)),
        worker_bridge_ends=tuple(_ifname(run_id, f"v{dc}-{i}") for i in range(workers)),
        worker_addresses=tuple(f"{subnet}.{10 + i}" for i in range(workers)),
        rates=tuple((w.up_gbit, w.down_gbit) for w in spec.workers) if spec is not None else (),
        worker_uplink_ifbs=tuple(_ifname(run_id, f"u{dc}-{i}") for i in range(workers)),
        gateway_gbit=spec.gateway_gbit if spec is not None else None,
        racks=rack_links([(r.id, r.uplink_gbit) for r in spec.racks], [w.rack for w in spec.workers],
                         name=lambda kind, k: _ifname(run_id, f"{kind}{dc}-{k}")) if spec is not None else (),
    )
