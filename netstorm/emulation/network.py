"""The emulated WAN of one run: build it from a scenario, re-shape it, run processes in it, tear it down.

``with EmulatedNetwork(scenario, bw_scale=0.25) as net:`` builds every namespace, link, route and
shaper, and on leaving (normally, by exception, Ctrl-C or SIGTERM turned into an exception by the
caller) kills every process it started and deletes every namespace. A run registry record exists from
before the first namespace until after the last one is gone, so a run killed with SIGKILL is found and
removed by ``netstorm emulate --cleanup``.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from netstorm.emulation import lossfilter, netns, racks, registry, shaping
from netstorm.emulation.bridge_lan import quiet_bridge
from netstorm.emulation.errors import EmulationError
from netstorm.emulation.teardown import cleanup, teardown_record
from netstorm.emulation.topology import MGMT_HOST, Plan, build_plan
from netstorm.scenario import Rates, Scenario

log = logging.getLogger(__name__)

_FORWARDING = {
    "net.ipv4.ip_forward": "1",
    "net.ipv4.conf.all.rp_filter": "0",
    "net.ipv4.conf.default.rp_filter": "0",
    # A tree edge idles between its chunks; restarting from the initial window after every gap would
    # charge each chunk a slow start that a long-lived WAN transfer does not pay.
    "net.ipv4.tcp_slow_start_after_idle": "0",
}


@dataclasses.dataclass(frozen=True)
class Features:
    """What this emulation applies of the scenario, and what it cannot, with the reason."""

    applied: tuple[str, ...]
    not_applied: dict[str, str]

    def lines(self) -> list[str]:
        out = [f"applied: {', '.join(self.applied)}"]
        out += [f"NOT applied: {name}: {why}" for name, why in self.not_applied.items()]
        return out


LINK_DOWN_PREF = 49
"""tc filter preference of the drop-everything filter that takes a link down (``set_link``)."""


class EmulatedNetwork:
    """One run's namespaces, shaped links, routes, management network and processes."""

    def __init__(self, scenario: Scenario, *, bw_scale: float = 1.0, loss: bool = True,
                 record: registry.RunRecord | None = None, lan_bw_scale: float = 1.0,
                 lan_uplink: str = "veth") -> None:
        if bw_scale <= 0:
            raise EmulationError(f"--bw-scale must be positive, got {bw_scale}")
        if not lan_bw_scale > 0:
            raise EmulationError(f"lan_bw_scale must be positive, got {lan_bw_scale}")
        self.scenario = scenario
        self.bw_scale = bw_scale
        self.lan_bw_scale = lan_bw_scale
        if lan_uplink not in shaping.UPLINK_MODES:
            raise EmulationError(f"lan_uplink_shaping is one of {', '.join(shaping.UPLINK_MODES)}, got {lan_uplink!r}")
        self.lan_uplink = lan_uplink
        self._want_loss = loss
        if record is None:
            # the start-up sweep: namespaces (and their qdiscs), bpffs mounts and records of runs whose owner
            # died without tearing down; live runs of other owners are left alone
            swept = cleanup()
            if swept.runs or swept.namespaces:
                log.info("emulation: removed what dead runs left: %s", "; ".join(swept.lines()))
        self.record = record or registry.reserve(netns.list_namespaces())
        self.plan: Plan = build_plan(scenario, self.record.run_id)
        self.rates: Rates = {}
        self.features = Features((), {})
        self._processes: list[subprocess.Popen[bytes]] = []
        self._built = False

    @property
    def run_id(self) -> str:
        return self.plan.run_id

    @property
    def scheduler_host(self) -> str:
        """The management address processes in any DC reach the scheduler on."""
        return MGMT_HOST

    def node_address(self, dc: int) -> str:
        return self.plan.node_addresses[dc]

    def namespace(self, dc: int) -> str:
        return self.plan.namespaces[dc]

    # building -----------------------------------------------------------------------------------

    def build(self) -> None:
        plan = self.plan
        self.record.namespaces = plan.all_namespaces
        self.record.save()
        try:
            for name in plan.all_namespaces:
                netns.add_namespace(name)
            for name in plan.all_namespaces:
                netns.sysctl(name, _FORWARDING)
            self._build_links()
            self._build_mgmt()
            self._build_lans()
            self._shape(self.scenario.rates())
            self._shape_lans()
            self.features = self._apply_impairments()
        except BaseException:
            self.close()
            raise
        self._built = True

    def _build_links(self) -> None:
        plan = self.plan
        seen: set[frozenset[int]] = set()
        create: list[str] = []
        for (src, dst), iface in plan.interfaces.items():
            pair = frozenset((src, dst))
            if pair in seen:
                continue
            seen.add(pair)
            peer = plan.interfaces[(dst, src)]
            create.append(f"link add {iface.name} netns {iface.namespace} type veth "
                          f"peer name {peer.name} netns {peer.namespace}")
        netns.ip_batch(create, what="create the overlay's veth pairs")
        per_ns: dict[str, list[str]] = {name: ["link set lo up"] for name in plan.namespaces.values()}
        for dc, ns in plan.namespaces.items():
            per_ns[ns].append(f"address add {plan.node_addresses[dc]}/32 dev lo")
        for iface in plan.interfaces.values():
            per_ns[iface.namespace] += [
                f"address add {iface.address} dev {iface.name}",
                f"link set dev {iface.name} gso_max_size {shaping.GSO_MAX_SIZE}",
                f"link set dev {iface.name} up",
            ]
        for route in plan.routes:
            per_ns[route.namespace].append(
                f"route add {route.destination} via {route.via} dev {route.device} src {route.source}")
        for ns, lines in per_ns.items():
            netns.ip_batch(lines, namespace=ns, what=f"address and route {ns}")

    def _build_mgmt(self) -> None:
        plan = self.plan
        mgmt = plan.mgmt_namespace
        create = [f"link add {port.dc_end} netns {plan.namespaces[dc]} type veth "
                  f"peer name {port.bridge_end} netns {mgmt}" for dc, port in plan.mgmt_ports.items()]
        netns.ip_batch(create, what="create the management veth pairs")
        lines = ["link set lo up", f"link add {plan.bridge} type bridge",
                 f"address add {MGMT_HOST}/24 dev {plan.bridge}", f"link set {plan.bridge} up"]
        for port in plan.mgmt_ports.values():
            lines += [f"link set {port.bridge_end} master {plan.bridge}", f"link set {port.bridge_end} up"]
        netns.ip_batch(lines, namespace=mgmt, what="build the management bridge")
        for dc, port in plan.mgmt_ports.items():
            netns.ip_batch([f"address add {port.address} dev {port.dc_end}", f"link set {port.dc_end} up"],
                           namespace=plan.namespaces[dc], what=f"management port of DC {dc}")

    def _build_lans(self) -> None:
        """Per DC with LAN workers: a bridge namespace, the gateway's veth into the DC, one veth per worker."""
        for dc, lan in self.plan.lans.items():
            create = [f"link add {lan.gateway_iface} netns {self.plan.namespaces[dc]} type veth "
                      f"peer name {lan.gateway_bridge_end} netns {lan.bridge_namespace}"]
            create += [f"link add {iface} netns {ns} type veth peer name {end} netns {lan.bridge_namespace}"
                       for iface, ns, end in zip(lan.worker_ifaces, lan.worker_namespaces,
                                                 lan.worker_bridge_ends, strict=True)]
            netns.ip_batch(create, what=f"create the LAN veth pairs of DC {dc}")
            lines = ["link set lo up", f"link add {lan.bridge} type bridge", f"link set {lan.bridge} up"]
            lines += racks.build_lines(lan.racks, lan.bridge)
            for end, bridge in ((lan.gateway_bridge_end, lan.bridge),
                                *((end, lan.worker_bridge(i)) for i, end in enumerate(lan.worker_bridge_ends))):
                lines += [f"link set {end} master {bridge}", f"link set {end} up"]
            netns.ip_batch(lines, namespace=lan.bridge_namespace, what=f"build the LAN bridge of DC {dc}")
            quiet_bridge(lan.bridge_namespace)
            netns.ip_batch([f"address add {lan.gateway_address}/24 dev {lan.gateway_iface}",
                            f"link set {lan.gateway_iface} up"],
                           namespace=self.plan.namespaces[dc], what=f"gateway interface of DC {dc}")
            for i, (ns, iface) in enumerate(zip(lan.worker_namespaces, lan.worker_ifaces, strict=True)):
                netns.ip_batch(["link set lo up", f"address add {lan.worker_addresses[i]}/24 dev {iface}",
                                f"link set {iface} up"], namespace=ns, what=f"LAN worker {i} of DC {dc}")

    def _shape_lans(self) -> None:
        """Each described LAN's ports at the scenario's rates x ``lan_bw_scale``: a worker's downlink on
        its bridge port, its uplink on its own interface or through an ifb device (``lan_uplink``, see
        ``shaping``), the gateway's port both ways (``shaping.lan_port_lines``), each rack's link to the DC's
        bridge both ways at the rack's uplink (``racks``)."""
        scale = self.lan_bw_scale
        for dc, lan in self.plan.lans.items():
            bridge: list[str] = racks.shape_lines(self.rack_links(dc))
            if lan.gateway_gbit is not None:
                bridge += shaping.lan_port_lines(lan.gateway_bridge_end, lan.gateway_gbit * scale)
                netns.tc_batch(shaping.lan_port_lines(lan.gateway_iface, lan.gateway_gbit * scale),
                               namespace=self.plan.namespaces[dc], what=f"shape the LAN gateway port of DC {dc}")
            for i, (up, down) in enumerate(lan.rates):
                bridge += shaping.lan_port_lines(lan.worker_bridge_ends[i], down * scale)
                if self.lan_uplink == "ifb":
                    ifb = lan.worker_uplink_ifbs[i]
                    netns.ip_batch(shaping.ifb_device_lines(ifb), namespace=lan.bridge_namespace,
                                   what=f"uplink device of LAN worker {i} in DC {dc}")
                    bridge += shaping.ifb_uplink_lines(lan.worker_bridge_ends[i], ifb)
                    bridge += shaping.lan_port_lines(ifb, up * scale)
                else:
                    netns.tc_batch(shaping.lan_port_lines(lan.worker_ifaces[i], up * scale),
                                   namespace=lan.worker_namespaces[i], what=f"shape LAN worker {i}'s uplink in DC {dc}")
            netns.tc_batch(bridge, namespace=lan.bridge_namespace, what=f"shape the LAN ports of DC {dc}")

    def rack_links(self, dc: int) -> tuple[racks.RackLink, ...]:
        """DC ``dc``'s emulated racks with their uplinks at the scenario's rate x ``lan_bw_scale``."""
        return tuple(dataclasses.replace(r, gbit=r.gbit * self.lan_bw_scale) for r in self.plan.lans[dc].racks)

    def rack_record(self) -> dict[str, list[dict[str, Any]]]:
        """Per DC with racks, its emulated racks and their uplinks' rates read back from the kernel."""
        return {str(dc): racks.record(lan.bridge_namespace, self.rack_links(dc))
                for dc, lan in sorted(self.plan.lans.items()) if lan.racks}

    def _shape(self, rates: Rates) -> None:
        per_ns: dict[str, list[str]] = {}
        for direction, iface in self.plan.interfaces.items():
            per_ns.setdefault(iface.namespace, []).extend(
                shaping.setup_lines(iface.name, rates[direction] * self.bw_scale))
        for ns, lines in per_ns.items():
            netns.tc_batch(lines, namespace=ns, what=f"shape the links of {ns}")
        self.rates = dict(rates)

    def _apply_impairments(self) -> Features:
        applied = ["per-direction HTB rates", "shortest-hop static routes", "unshaped management network"]
        not_applied: dict[str, str] = {}
        if self.plan.lans:
            workers = ", ".join(f"DC {dc}: {lan.workers}" for dc, lan in sorted(self.plan.lans.items()))
            applied.append(f"LAN workers behind the DC gateway ({workers}) on a bridge")
            shaped = {dc: lan for dc, lan in sorted(self.plan.lans.items()) if lan.rates}
            if shaped:
                k = self.lan_bw_scale
                spans = ", ".join(f"DC {dc}: {min(map(min, lan.rates)) * k:g}-{max(map(max, lan.rates)) * k:g}"
                                  for dc, lan in shaped.items())
                applied.append(f"per-worker LAN HTB rates x{self.lan_bw_scale:g} (Gbit/s {spans}; uplinks on "
                               f"{self.lan_uplink})")
            racked = "; ".join(f"DC {dc}: " + ", ".join(f"rack {r.rack} {r.gbit:g}" for r in self.rack_links(dc))
                               for dc, lan in sorted(self.plan.lans.items()) if lan.racks)
            if racked:
                applied.append(f"racks on their own bridges behind HTB-shaped uplinks (Gbit/s {racked})")
            unshaped = [str(dc) for dc, lan in sorted(self.plan.lans.items()) if not lan.rates]
            if unshaped:
                not_applied["lan rates"] = (f"the scenario describes no LAN for DC {', '.join(unshaped)}: "
                                            "its bridge is not shaped")
        latency = {lk.latency_ms for lk in self.scenario.links if lk.latency_ms > 0}
        losses = {(lk.a, lk.b): lk.loss for lk in self.scenario.links if lk.loss > 0}
        if (latency or losses) and lossfilter.netem_available(self.plan.mgmt_namespace):
            self._apply_netem()
            if latency:
                applied.append(f"one-way latency {sorted(latency)} ms via netem")
            if losses and self._want_loss:
                applied.append(f"packet loss {sorted(set(losses.values()))} via netem")
            elif losses:
                not_applied["loss"] = "disabled with --no-loss"
            return Features(tuple(applied), not_applied)
        if latency:
            not_applied["latency"] = (f"this kernel has no netem; the scenario's {sorted(latency)} ms one-way "
                                      "latency was NOT applied")
        if losses:
            status = lossfilter.bcc_status()
            if not self._want_loss:
                not_applied["loss"] = "disabled with --no-loss"
            elif status is not None:
                not_applied["loss"] = f"no netem and {status}"
            else:
                targets: dict[tuple[str, str], float] = {}
                for (a, b), p in losses.items():
                    for src, dst in ((a, b), (b, a)):
                        iface = self.plan.interfaces[(src, dst)]
                        targets[(iface.namespace, iface.name)] = p
                bpf_dir = Path(f"/run/netstorm-emu-bpf-{self.run_id}")

                def remember(path: Path) -> None:
                    self.record.bpf_mount = str(path)
                    self.record.save()

                lossfilter.attach(targets, bpf_dir, on_mount=remember)
                self.record.bpf_mount = None
                self.record.save()
                applied.append(f"packet loss {sorted(set(losses.values()))} via a tc BPF filter")
        return Features(tuple(applied), not_applied)

    def _apply_netem(self) -> None:
        """Where the kernel has netem: latency and loss as a netem leaf under each direction's HTB class."""
        per_ns: dict[str, list[str]] = {}
        for (src, dst), iface in self.plan.interfaces.items():
            link = self.scenario.link(src, dst)
            per_ns.setdefault(iface.namespace, []).extend(
                shaping.netem_lines(iface.name, link.latency_ms, link.loss if self._want_loss else 0.0))
        for ns, lines in per_ns.items():
            netns.tc_batch(lines, namespace=ns, what=f"add netem latency/loss in {ns}")

    # running ------------------------------------------------------------------------------------

    def set_rates(self, rates: Rates) -> None:
        """Re-shape every direction to ``rates`` (scenario Mbit/s, scaled by bw_scale) in place."""
        per_ns: dict[str, list[str]] = {}
        for direction, iface in self.plan.interfaces.items():
            per_ns.setdefault(iface.namespace, []).extend(
                shaping.change_lines(iface.name, rates[direction] * self.bw_scale))
        for ns, lines in per_ns.items():
            netns.tc_batch(lines, namespace=ns, what=f"re-shape the links of {ns}")
        self.rates = dict(rates)

    def set_link(self, a: int, b: int, up: bool) -> None:
        """Take the overlay link a-b down (every packet arriving over it, either way, is dropped at the
        receiving end's ingress; routes and TCP connections stay, as when a WAN link fails) or up again.
        The drop filter is the loss filter's program at probability 1, on ingress (it needs bcc)."""
        for src, dst in ((a, b), (b, a)):
            iface = self.plan.interfaces.get((src, dst))
            if iface is None:
                raise EmulationError(f"no overlay link {a}-{b}")
            ns, dev = iface.namespace, iface.name
            if up:
                netns.run(["tc", "-n", ns, "filter", "del", "dev", dev, "ingress", "pref", str(LINK_DOWN_PREF)],
                          what=f"take link {a}-{b} up")
            else:
                lossfilter.attach_drop(ns, dev, Path(tempfile.mkdtemp(prefix="netstorm-linkdown-")),
                                       pref=LINK_DOWN_PREF)

    def spawn(self, where: int | str | tuple[int, int], argv: Sequence[str], *,
              env: Mapping[str, str] | None = None, stdout: IO[bytes] | int | None = None,
              stderr: IO[bytes] | int | None = None,
              stdin: IO[bytes] | int | None = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
        """Start ``argv`` in DC ``where``'s namespace (``"mgmt"``, or ``(dc, i)`` for LAN worker i of DC
        dc); it is killed on close()."""
        if isinstance(where, tuple):
            ns = self.plan.lans[where[0]].worker_namespaces[where[1]]
        else:
            ns = self.plan.mgmt_namespace if where == "mgmt" else self.plan.namespaces[int(where)]
        proc = netns.spawn(ns, argv, env=env, stdout=stdout, stderr=stderr, stdin=stdin)
        self._processes.append(proc)
        return proc

    def stop_processes(self, grace_s: float = 3.0) -> None:
        """Terminate every process this network started (and anything else left in its namespaces)."""
        live = [p.pid for p in self._processes if p.poll() is None]
        netns.terminate(live, grace_s=grace_s)
        for proc in self._processes:
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("process %d did not exit after SIGKILL", proc.pid)
        self._processes.clear()

    # teardown -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process, delete every namespace (and with them every link), drop the record."""
        started = time.monotonic()
        self.stop_processes()
        teardown_record(self.record)
        log.info("run %s torn down in %.1f s", self.run_id, time.monotonic() - started)

    def __enter__(self) -> EmulatedNetwork:
        if not self._built:
            self.build()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
