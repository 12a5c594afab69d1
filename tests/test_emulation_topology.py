"""The emulated network's plan: names fit the kernel and carry the run id, routes are the static ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from netstorm.emulation.errors import EmulationError
from netstorm.emulation.topology import IFNAMSIZ, build_plan, run_of_namespace
from netstorm.routing import shortest_hop_routes
from netstorm.scenario import load

DATA = Path(__file__).parent / "data"


def test_names_are_unique_short_and_carry_the_run_id() -> None:
    plan = build_plan(load("internet2-9"), "0a1f")
    ifnames = [i.name for i in plan.interfaces.values()]
    ifnames += [p.dc_end for p in plan.mgmt_ports.values()] + [p.bridge_end for p in plan.mgmt_ports.values()]
    ifnames.append(plan.bridge)
    assert len(ifnames) == len(set(ifnames)) == 2 * 13 + 2 * 9 + 1
    assert all(len(n) <= IFNAMSIZ and "0a1f" in n for n in ifnames)
    assert all(run_of_namespace(ns) == "0a1f" for ns in plan.all_namespaces)
    assert run_of_namespace("nsefoo-1") is None
    assert run_of_namespace("other") is None


def test_each_direction_has_its_own_egress_and_the_link_shares_one_subnet() -> None:
    plan = build_plan(load(DATA / "emu-4.toml"), "beef")
    for (src, dst), iface in plan.interfaces.items():
        back = plan.interfaces[(dst, src)]
        assert iface.namespace == plan.namespaces[src]
        assert iface.peer_address == back.address.split("/")[0]
        assert iface.address.rsplit(".", 1)[0] == back.address.rsplit(".", 1)[0]


def test_routes_are_exactly_the_shortest_hop_routes() -> None:
    scenario = load("internet2-9")
    plan = build_plan(scenario, "0001")
    expected = shortest_hop_routes(scenario.node_ids, [(lk.a, lk.b) for lk in scenario.links])
    by_address = {addr: dc for dc, addr in plan.node_addresses.items()}
    ns_to_dc = {ns: dc for dc, ns in plan.namespaces.items()}
    assert len(plan.routes) == 9 * 8
    for route in plan.routes:
        src = ns_to_dc[route.namespace]
        dst = by_address[route.destination.split("/")[0]]
        iface = next(i for i in plan.interfaces.values() if i.name == route.device)
        assert (iface.src, iface.dst) == (src, expected[(src, dst)][1])
        assert route.source == plan.node_addresses[src]
    # 1 -> 9 has no path shorter than four hops (checked by hand on the overlay).
    assert expected[(1, 9)] == (1, 3, 4, 6, 9)


@pytest.mark.parametrize("run_id", ["", "12345", "ABCD", "zz00"])
def test_bad_run_ids_are_rejected(run_id: str) -> None:
    with pytest.raises(EmulationError, match="run id"):
        build_plan(load(DATA / "emu-4.toml"), run_id)


def test_tc_lines_use_exact_kbit_put_acks_first_and_netem_under_both_leaves() -> None:
    from netstorm.emulation import shaping

    lines = shaping.setup_lines("x", 13.5)
    assert lines[0] == "qdisc add dev x root handle 1: htb default 20"
    assert lines[1] == "class add dev x parent 1: classid 1:1 htb rate 13500kbit ceil 13500kbit"
    # 5 % of 13500 kbit guaranteed to pure ACKs at priority 0, the rest to data; both may use the whole link
    assert lines[2] == "class add dev x parent 1:1 classid 1:10 htb rate 675kbit ceil 13500kbit prio 0"
    assert lines[3] == "class add dev x parent 1:1 classid 1:20 htb rate 12825kbit ceil 13500kbit prio 1"
    assert lines[4].startswith("filter add dev x parent 1: protocol ip prio 1 u32 match ip protocol 6 0xff")
    assert lines[4].endswith("flowid 1:10")
    assert shaping.change_lines("x", 0.25 * 155)[0] == (
        "class change dev x parent 1: classid 1:1 htb rate 38750kbit ceil 38750kbit")
    assert [line.split(" classid ")[1].split(" prio")[0] for line in shaping.change_lines("x", 0.25 * 155)[1:]] == [
        "1:10 htb rate 1938kbit ceil 38750kbit", "1:20 htb rate 36812kbit ceil 38750kbit"]
    assert shaping.netem_lines("x", 30.0, 0.0002) == [
        "qdisc add dev x parent 1:10 handle 10: netem limit 100000 delay 30ms loss 0.02%",
        "qdisc add dev x parent 1:20 handle 20: netem limit 100000 delay 30ms loss 0.02%"]
    with pytest.raises(EmulationError):
        shaping.kbit(0)
