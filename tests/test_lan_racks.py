"""Racks in the namespace LAN: each rack's workers on their own bridge behind a link shaped both ways to
the rack's uplink (x the LAN rate scale), read back from the kernel; a worker behind a rack reaches the
gateway and the gateway it; and sums over a racked LAN stay exact on both aggregation paths, with the
results multicast across the rack links to the members and the members' DATA crossing their rack's uplink."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from netstorm.emulation import netns, racks, shaping
from netstorm.emulation.errors import EmulationError
from netstorm.lan.layout import EdgeLayout

RACKS = [(1, 4.0), (2, 3.0), (9, 1.0)]
"""(id, uplink Gbit/s); rack 9 holds no worker, so it is not emulated."""
WORKER_RACKS = [1, 2, None, 1]
SCALE = 0.25


def test_rack_links_keep_the_racks_with_workers_scaled_and_named() -> None:
    links = racks.rack_links(RACKS, WORKER_RACKS, name=lambda kind, k: f"x{kind}{k}", scale=SCALE)
    assert [(r.rack, r.workers, r.gbit) for r in links] == [(1, (0, 3), 1.0), (2, (1,), 0.75)]
    assert (links[1].bridge, links[1].rack_end, links[1].dc_end) == ("xr1", "xru1", "xrd1")
    assert racks.rack_of(links, 3) is links[0] and racks.rack_of(links, 2) is None
    lines = racks.build_lines(links, "br0")
    assert "link set xrd0 master br0 up" in lines and "link set xru0 master xr0 up" in lines
    assert sum("mcast_router 2" in line for line in lines) == 4   # both ends of both links
    shaped = racks.shape_lines(links)
    assert shaped[:5] == shaping.lan_port_lines("xru0", 1.0) and shaped[-5:] == shaping.lan_port_lines("xrd1", 0.75)
    with pytest.raises(EmulationError, match=r"racks \[5\]"):
        racks.rack_links(RACKS, [1, 5], name=lambda kind, k: kind)
    with pytest.raises(EmulationError, match="duplicate"):
        racks.rack_links([(1, 1.0), (1, 2.0)], [1], name=lambda kind, k: kind)


def test_a_lan_refuses_rack_ids_for_another_worker_count() -> None:
    from netstorm.emulation.bridge_lan import Lan

    with pytest.raises(EmulationError, match="racks for 2 workers"):
        Lan(3, racks=[(1, 1.0)], worker_racks=[1, 1])


def test_bench_edge_gives_a_scenario_dcs_racks_to_its_lan_at_the_lans_scale() -> None:
    import argparse

    from netstorm.bench import edge

    def args_for(name: str, dc: int) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        edge.add_arguments(parser)
        args = parser.parse_args(["--lan-scenario", name, "--dc", str(dc), "--lan-bw-scale", "0.005"])
        edge.apply_lan_scenario(args)
        return args

    racked = args_for("lan-hetero-4", 2)   # two racks of four behind 4 Gbit/s uplinks, workers dealt in turn
    assert edge._racks(racked) == {"racks": [(1, pytest.approx(0.02)), (2, pytest.approx(0.02))],
                                   "worker_racks": [1, 2] * 4}
    assert edge._racks(args_for("lan-hetero-4", 1)) == {}   # no racks: one bridge, as before


def _ports_of(namespace: str, bridge: str) -> set[str]:
    out = netns.run(["ip", "-n", namespace, "-o", "link", "show", "master", bridge], what=f"ports of {bridge}")
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.strip()}


def _echo(here: tuple[str, str], there: tuple[str, str], port: int) -> bytes:
    """A datagram from ``here`` (namespace, address) to ``there`` and its echo back; the bytes echoed."""

    def bound(ns: str, host: str) -> socket.socket:
        def make() -> socket.socket:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((host, port))
            s.settimeout(5.0)
            return s

        return netns.run_in(ns, make)

    a, b = bound(*here), bound(*there)
    try:
        a.sendto(b"rack", (there[1], port))
        data, peer = b.recvfrom(64)
        b.sendto(data + b"!", peer)
        return bytes(a.recvfrom(64)[0])
    finally:
        a.close()
        b.close()


@pytest.mark.root
def test_rack_uplinks_hold_their_scaled_rates_and_workers_behind_them_reach_the_gateway() -> None:
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan

    with Lan(4, rates=[(1.0, 1.0)] * 4, rate_scale=SCALE, racks=RACKS, worker_racks=WORKER_RACKS) as lan:
        assert [r.rack for r in lan.racks] == [1, 2]
        for link, (_, uplink) in zip(lan.racks, RACKS, strict=False):
            for end in (link.rack_end, link.dc_end):
                classes = shaping.read_classes(lan.bridge, end)
                assert set(classes) == {"1:1", "1:10", "1:20"}
                assert classes["1:1"].rate_bit == pytest.approx(uplink * SCALE * 1e9)
                assert classes["1:1"].ceil_bit == classes["1:1"].rate_bit
            detail = netns.run(["ip", "-n", lan.bridge, "-d", "link", "show", link.dc_end], what="rack port")
            assert "mcast_router 2" in detail
        assert _ports_of(lan.bridge, "r0") == {"w0", "w3", "ru0"}
        assert _ports_of(lan.bridge, "r1") == {"w1", "ru1"}
        assert _ports_of(lan.bridge, "br0") == {"g", "w2", "rd0", "rd1"}
        recorded = lan.rack_record()
        assert [(r["rack"], r["workers"], r["kernel_uplink_gbit"], r["kernel_downlink_gbit"]) for r in recorded] == [
            (1, [0, 3], 1.0, 1.0), (2, [1], 0.75, 0.75)]
        for i in (0, 1, 2):
            assert _echo((lan.workers[i], lan.worker_ip(i)), (lan.gateway, GATEWAY_IP), 9660 + i) == b"rack!"
        sent = shaping.read_classes(lan.bridge, "ru0")["1:1"].sent_packets
        assert sent >= 1   # worker 0's datagram left its rack through the shaped uplink
        assert set(lan.drops()["racks"]) == {"1", "2"}


RACKED_SCENARIO = """\
name = "lan-racked"
[[node]]
id = 1
[[node]]
id = 2
[[node.lan.rack]]
id = 4
aggregator_gbit = 8.0
uplink_gbit = 2.0
[[node.lan.worker]]
up_gbit = 1.0
rack = 4
[[node.lan.worker]]
up_gbit = 1.0
rack = 4
[[node.lan.worker]]
up_gbit = 1.0
[[link]]
a = 1
b = 2
rate_mbit = [100, 100]
"""


def test_the_emulation_plans_a_bridge_per_rack_with_short_run_named_devices(tmp_path: Path) -> None:
    from netstorm.emulation.topology import IFNAMSIZ, build_plan
    from netstorm.scenario import load

    path = tmp_path / "racked.toml"
    path.write_text(RACKED_SCENARIO)
    lan = build_plan(load(path), "ab12").lans[2]
    (rack,) = lan.racks
    assert (rack.rack, rack.workers, rack.gbit) == (4, (0, 1), 2.0)
    assert [lan.worker_bridge(i) for i in range(3)] == [rack.bridge, rack.bridge, lan.bridge]
    names = (rack.bridge, rack.rack_end, rack.dc_end, lan.bridge, *lan.worker_bridge_ends, lan.gateway_bridge_end)
    assert len(set(names)) == len(names) and all(n.startswith("nab12-") and len(n) <= IFNAMSIZ for n in names)


@pytest.mark.root
def test_an_emulated_dc_puts_its_racks_behind_their_scaled_uplinks(tmp_path: Path) -> None:
    from netstorm.emulation.network import EmulatedNetwork
    from netstorm.scenario import load

    path = tmp_path / "racked.toml"
    path.write_text(RACKED_SCENARIO)
    with EmulatedNetwork(load(path), lan_bw_scale=0.25) as net:
        lan = net.plan.lans[2]
        (rack,) = lan.racks
        assert any("behind HTB-shaped uplinks" in line and "rack 4 0.5" in line for line in net.features.applied)
        assert _ports_of(lan.bridge_namespace, rack.bridge) == {*lan.worker_bridge_ends[:2], rack.rack_end}
        for end in (rack.rack_end, rack.dc_end):
            assert shaping.read_classes(lan.bridge_namespace, end)["1:1"].rate_bit == pytest.approx(0.5e9)
        assert net.rack_record() == {"2": [{"rack": 4, "workers": [0, 1], "uplink_gbit": 0.5,
                                            "kernel_uplink_gbit": 0.5, "kernel_downlink_gbit": 0.5}]}
        gateway = (net.namespace(2), lan.gateway_address)
        assert _echo((lan.worker_namespaces[0], lan.worker_addresses[0]), gateway, 9665) == b"rack!"
        names = lan.namespaces
    assert not set(names) & set(netns.list_namespaces())


LAYOUT = EdgeLayout.uniform([5000, 1234, 7], scale=16, lanes=357)
JOB = 19
PORT = 9670
GROUP = ("239.77.0.19", 9671)
ITERATIONS = 2


@pytest.fixture(scope="module")
def xdp_program() -> Iterator[Any]:
    from bpf.xdp import XdpAggregator

    agg = XdpAggregator(LAYOUT, job=JOB, port=PORT, expected=1, timeout=0.1)
    yield agg
    agg.close()


def _reference(contribs: list[list[np.ndarray]]) -> list[np.ndarray]:
    out = []
    for t in range(len(LAYOUT.sizes)):
        total = np.sum([np.rint(w[t].astype(np.float64) * 2.0**16).astype(np.int64) for w in contribs], axis=0)
        out.append((total.astype(np.float64) * 2.0**-16).astype(np.float32))
    return out


async def _sums(lan: Any, mode: str, xdp: Any) -> None:
    from bpf.agent import EdgeAgent
    from netstorm.emulation.bridge_lan import GATEWAY_IP
    from netstorm.lan.sender import EdgeSender

    n = len(lan.workers)
    rng = np.random.default_rng(19)
    agent = EdgeAgent(lan.udp_socket(lan.gateway, GATEWAY_IP, PORT), LAYOUT, workers=n, job=JOB, mode=mode,
                      xdp=xdp, slot_timeout=0.1, group=GROUP, retransmit=1.0)
    nodes = [EdgeSender(lan.udp_socket(ns, lan.worker_ip(i)), (GATEWAY_IP, PORT), worker=i, layout=LAYOUT, job=JOB,
                        group_opener=lan.group_opener(ns)) for i, ns in enumerate(lan.workers)]
    try:
        async with asyncio.TaskGroup() as tg:
            serving = tg.create_task(agent.run())
            try:
                await asyncio.gather(*(node.hello(timeout=10) for node in nodes))
                await agent.wait_workers(timeout=10)
                for k in range(1, ITERATIONS + 1):
                    contribs = [[rng.standard_normal(s).astype(np.float32) for s in LAYOUT.sizes] for _ in nodes]
                    pushes = [tg.create_task(node.push_pull(k, contribs[node.worker], timeout=30)) for node in nodes]
                    sums = await agent.collect(k, timeout=30)
                    want = _reference(contribs)
                    for got, exact in zip(sums, want, strict=True):
                        np.testing.assert_array_equal(got, exact)
                    await agent.send_results(k, sums, total=n)
                    for push in pushes:   # every member got the multicast result, racked or not
                        got_sums, total = await push
                        assert total == n
                        for got, exact in zip(got_sums, want, strict=True):
                            np.testing.assert_array_equal(got, exact)
            finally:
                agent.close()
                await serving
    finally:
        for node in nodes:
            node.close()


@pytest.mark.root
@pytest.mark.slow
def test_sums_over_a_racked_lan_are_exact_and_cross_the_rack_links(mode: str, request: pytest.FixtureRequest) -> None:
    from netstorm.emulation.bridge_lan import Lan
    from netstorm.emulation.netns import run_in

    with Lan(3, rates=[(1.0, 1.0)] * 3, rate_scale=0.1, racks=[(1, 2.0)], worker_racks=[1, 1, None]) as lan:
        xdp = None
        if mode == "xdp":
            xdp = request.getfixturevalue("xdp_program")
            xdp.configure(job=JOB, port=PORT, expected=0b111, timeout=0.1, max_nacks=20)
            ifindex = lan.gateway_ifindex()
            run_in(lan.gateway, lambda: xdp.attach(ifindex))
        try:
            asyncio.run(_sums(lan, mode, xdp))
            payload = sum(LAYOUT.sizes) * 4 * ITERATIONS   # lanes of one worker's DATA, or of one result
            up = shaping.read_classes(lan.bridge, "ru0")["1:1"].sent_bytes
            down = shaping.read_classes(lan.bridge, "rd0")["1:1"].sent_bytes
            assert up >= 2 * payload   # both racked workers' DATA went up their rack's link
            assert down >= payload     # the results came down it (once per rack: multicast)
        finally:
            if xdp is not None:
                run_in(lan.gateway, xdp.detach)
