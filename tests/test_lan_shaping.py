"""Per-worker LAN shaping: each worker's uplink and downlink are HTB classes at its scenario rates, read
back from the kernel, and a worker shaped far below another finishes the same transfer last, both ways."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from netstorm.emulation import netns, shaping
from netstorm.emulation.errors import EmulationError

TC_TEXT = """\
class htb 1:10 parent 1:1 prio 0 rate 2Gbit ceil 40Gbit burst 5000000b cburst 5000000b
 Sent 90 bytes 1 pkt (dropped 0, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
class htb 1:1 root rate 2500Mbit ceil 2500Mbit burst 1250Kb cburst 1250Kb
 Sent 1234567 bytes 890 pkt (dropped 0, overlimits 0 requeues 0)
class htb 1:20 parent 1:1 prio 1 rate 800Kbit ceil 1Mbit burst 1600b cburst 1600b
"""


def test_tc_class_text_parses_into_rates_buckets_and_counters() -> None:
    classes = shaping.parse_classes(TC_TEXT)
    assert set(classes) == {"1:1", "1:10", "1:20"}
    link = classes["1:1"]
    assert link.parent is None and link.rate_bit == 2.5e9 and link.ceil_bit == 2.5e9
    assert link.burst_bytes == 1250 * 1024 and (link.sent_bytes, link.sent_packets) == (1234567, 890)
    assert classes["1:10"].parent == "1:1" and classes["1:10"].ceil_bit == 40e9 and classes["1:10"].sent_bytes == 90
    assert classes["1:20"].rate_bit == 800e3 and classes["1:20"].ceil_bit == 1e6 and classes["1:20"].sent_bytes == 0


def test_a_lan_port_is_the_wan_tree_with_a_bucket_for_gbit_rates() -> None:
    lines = shaping.lan_port_lines("w3", 10.0)
    assert lines[0] == "qdisc add dev w3 root handle 1: htb default 20"
    assert "classid 1:1 htb rate 10000000kbit ceil 10000000kbit burst 1250000 cburst 1250000" in lines[1]
    assert "classid 1:10" in lines[2] and "prio 0" in lines[2] and "classid 1:20" in lines[3]
    assert lines[4].endswith("flowid 1:10")
    assert shaping.lan_burst(0.001) == shaping.LAN_MIN_BURST
    with pytest.raises(EmulationError, match="positive"):
        shaping.lan_port_lines("w0", 0.0)


def test_rates_must_match_the_workers_and_the_scale_be_positive() -> None:
    from netstorm.emulation.bridge_lan import Lan

    with pytest.raises(EmulationError, match="rates for 1 workers"):
        Lan(2, rates=[(1.0, 1.0)])
    with pytest.raises(EmulationError, match="scale must be positive"):
        Lan(1, rates=[(1.0, 1.0)], rate_scale=0.0)


@pytest.mark.root
@pytest.mark.parametrize("uplink", shaping.UPLINK_MODES)
def test_every_worker_port_holds_its_scaled_rates_in_the_kernel(uplink: str) -> None:
    from netstorm.emulation.bridge_lan import Lan

    rates = [(1.0, 4.0), (2.5, 0.5), (10.0, 10.0)]
    with Lan(3, rates=rates, gateway_gbit=40.0, rate_scale=0.5, uplink=uplink) as lan:
        for i, (up, down) in enumerate(rates):
            downlink = shaping.read_classes(lan.bridge, lan.bridge_port(i))
            uplink_ns, uplink_dev = lan.uplink_shaper(i)
            uplink_classes = shaping.read_classes(uplink_ns, uplink_dev)
            if uplink == "ifb":  # the worker's own end is left alone; its bridge port redirects to the ifb
                assert shaping.read_classes(lan.workers[i], "eth0") == {}
                redirect = netns.run(["tc", "-n", lan.bridge, "filter", "show", "dev", lan.bridge_port(i), "ingress"],
                                     what="read the redirect")
                assert f"Egress Redirect to device {uplink_dev}" in redirect
            for classes, gbit in ((downlink, down * 0.5), (uplink_classes, up * 0.5)):
                assert set(classes) == {"1:1", "1:10", "1:20"}
                link = classes["1:1"]
                assert link.rate_bit == pytest.approx(gbit * 1e9) and link.ceil_bit == link.rate_bit
                assert link.burst_bytes == pytest.approx(shaping.lan_burst(gbit), rel=0.01)  # kernel ticks round it
                leaves = classes["1:10"].rate_bit + classes["1:20"].rate_bit
                assert leaves == pytest.approx(link.rate_bit, rel=1e-3)  # tc prints whole Mbit
                assert classes["1:10"].ceil_bit == classes["1:20"].ceil_bit == link.rate_bit
        for ns, dev in ((lan.bridge, "g"), (lan.gateway, "eth0")):
            assert shaping.read_classes(ns, dev)["1:1"].rate_bit == pytest.approx(20e9)
        assert lan.rates == [(0.5, 2.0), (1.25, 0.25), (5.0, 5.0)]


@pytest.mark.root
def test_an_unshaped_lan_has_no_classes() -> None:
    from netstorm.emulation.bridge_lan import Lan

    with Lan(1) as lan:
        assert shaping.read_classes(lan.bridge, lan.bridge_port(0)) == {}
        assert shaping.read_classes(lan.workers[0], "eth0") == {}


PAYLOAD = 1 << 20
SLOW_GBIT = 0.02
FAST_GBIT = 2.0
"""A 100x ratio: the slow port needs at least 0.35 s for the payload beyond its bucket, the fast one a
few ms, so the order of completion says which port was shaped, whatever else the host is doing."""
DEADLINE_S = 60.0


def _transfers(lan: object, *, upward: bool) -> tuple[list[int], dict[int, int]]:
    """Send PAYLOAD between the gateway and each worker over TCP, the slow worker's transfer started
    first; the order in which the receivers got every byte, and the bytes each got."""
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.emulation.netns import run_in

    assert isinstance(lan, Lan)
    done: list[int] = []
    got: dict[int, int] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()
    listeners: dict[int, socket.socket] = {}
    for i in range(len(lan.workers)):
        ns, host = (lan.gateway, GATEWAY_IP) if upward else (lan.workers[i], lan.worker_ip(i))

        def listen(host: str = host, port: int = 9611 + i) -> socket.socket:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            s.listen(1)
            s.settimeout(DEADLINE_S)
            return s

        listeners[i] = run_in(ns, listen)

    def receive(i: int) -> None:
        try:
            conn, _ = listeners[i].accept()
            conn.settimeout(DEADLINE_S)
            total = 0
            while chunk := conn.recv(1 << 16):
                total += len(chunk)
            conn.close()
            with lock:
                got[i] = total
                done.append(i)
        except BaseException as exc:
            errors.append(exc)

    def send(i: int, connected: threading.Event) -> None:
        try:
            ns = lan.workers[i] if upward else lan.gateway
            target = (GATEWAY_IP, 9611 + i) if upward else (lan.worker_ip(i), 9611 + i)
            conn = run_in(ns, lambda: socket.create_connection(target, timeout=DEADLINE_S))
            connected.set()
            conn.sendall(b"\0" * PAYLOAD)
            conn.shutdown(socket.SHUT_WR)
            conn.recv(1)  # the receiver closes after the last byte
            conn.close()
        except BaseException as exc:
            errors.append(exc)
            connected.set()

    threads = [threading.Thread(target=receive, args=(i,)) for i in range(len(lan.workers))]
    for t in threads:
        t.start()
    senders = []
    for i in range(len(lan.workers)):  # worker 0, the slow one, connected first
        connected = threading.Event()
        t = threading.Thread(target=send, args=(i, connected))
        t.start()
        senders.append(t)
        assert connected.wait(DEADLINE_S), f"transfer {i} did not connect"
    for t in threads + senders:
        t.join(DEADLINE_S)
    for s in listeners.values():
        s.close()
    assert not errors, errors
    assert not any(t.is_alive() for t in threads + senders), "a transfer did not finish within its deadline"
    return done, got


@pytest.mark.root
@pytest.mark.parametrize("uplink", shaping.UPLINK_MODES)
def test_a_slow_uplink_finishes_after_a_fast_one_started_later(uplink: str) -> None:
    from netstorm.emulation.bridge_lan import Lan

    with Lan(2, rates=[(SLOW_GBIT, FAST_GBIT), (FAST_GBIT, FAST_GBIT)], uplink=uplink) as lan:
        done, got = _transfers(lan, upward=True)
        assert done == [1, 0] and got == {0: PAYLOAD, 1: PAYLOAD}
        for i in (0, 1):  # every byte passed the worker's uplink class
            assert shaping.read_classes(*lan.uplink_shaper(i))["1:1"].sent_bytes >= PAYLOAD


@pytest.mark.root
def test_a_slow_downlink_finishes_after_a_fast_one_started_later() -> None:
    from netstorm.emulation.bridge_lan import Lan

    with Lan(2, rates=[(FAST_GBIT, SLOW_GBIT), (FAST_GBIT, FAST_GBIT)]) as lan:
        done, got = _transfers(lan, upward=False)
        assert done == [1, 0] and got == {0: PAYLOAD, 1: PAYLOAD}
        for i in (0, 1):  # every byte passed the bridge port toward the worker
            assert shaping.read_classes(lan.bridge, lan.bridge_port(i))["1:1"].sent_bytes >= PAYLOAD


LAN_SCENARIO = """\
name = "lan-shaped"
[[node]]
id = 1
[[node]]
id = 2
[node.lan]
gateway_gbit = 8.0
[[node.lan.worker]]
up_gbit = 0.5
down_gbit = 2.0
[[node.lan.worker]]
up_gbit = 4.0
[[link]]
a = 1
b = 2
rate_mbit = [100, 100]
"""


def test_the_emulation_plans_each_described_workers_rates_and_leaves_others_unshaped(tmp_path: Path) -> None:
    from netstorm.emulation.runner import with_lan_workers
    from netstorm.emulation.topology import build_plan
    from netstorm.scenario import load

    path = tmp_path / "lan-shaped.toml"
    path.write_text(LAN_SCENARIO)
    plan = build_plan(load(path), "ab12")
    assert set(plan.lans) == {2}
    assert plan.lans[2].rates == ((0.5, 2.0), (4.0, 4.0)) and plan.lans[2].gateway_gbit == 8.0
    # --lan-workers with another count replaces the description: uniform, unshaped workers
    other = build_plan(with_lan_workers(load(path), 3), "ab12")
    assert all(lan.rates == () and lan.gateway_gbit is None for lan in other.lans.values())


def test_the_lan_rate_scale_is_an_option_like_every_other() -> None:
    from netstorm.config import ConfigError, resolve

    assert resolve().lan_bw_scale == 1.0
    assert resolve(environ={"NETSTORM_LAN_BW_SCALE": "0.1"}).lan_bw_scale == 0.1
    with pytest.raises(ConfigError, match="lan_bw_scale must be positive"):
        resolve(overrides={"lan_bw_scale": 0})
    assert resolve().lan_uplink_shaping == "veth"
    assert resolve(environ={"NETSTORM_LAN_UPLINK_SHAPING": "ifb"}).lan_uplink_shaping == "ifb"
    with pytest.raises(ConfigError, match="lan_uplink_shaping must be veth or ifb"):
        resolve(overrides={"lan_uplink_shaping": "police"})


@pytest.mark.root
@pytest.mark.parametrize("mode", shaping.UPLINK_MODES)
def test_an_emulated_lan_is_shaped_per_worker_at_the_scaled_rates(tmp_path: Path, mode: str) -> None:
    from netstorm.emulation.network import EmulatedNetwork
    from netstorm.scenario import load

    path = tmp_path / "lan-shaped.toml"
    path.write_text(LAN_SCENARIO)
    with EmulatedNetwork(load(path), lan_bw_scale=0.25, lan_uplink=mode) as net:
        lan = net.plan.lans[2]
        assert any("per-worker LAN HTB rates x0.25" in line and f"uplinks on {mode}" in line
                   for line in net.features.applied)
        for i, (up, down) in enumerate(((0.5, 2.0), (4.0, 4.0))):
            where = ((lan.bridge_namespace, lan.worker_uplink_ifbs[i]) if mode == "ifb"
                     else (lan.worker_namespaces[i], lan.worker_ifaces[i]))
            uplink = shaping.read_classes(*where)["1:1"]
            downlink = shaping.read_classes(lan.bridge_namespace, lan.worker_bridge_ends[i])["1:1"]
            assert uplink.rate_bit == pytest.approx(up * 0.25e9) and downlink.rate_bit == pytest.approx(down * 0.25e9)
        for ns, dev in ((net.namespace(2), lan.gateway_iface), (lan.bridge_namespace, lan.gateway_bridge_end)):
            assert shaping.read_classes(ns, dev)["1:1"].rate_bit == pytest.approx(2e9)
        names = lan.namespaces
    assert not set(names) & set(netns.list_namespaces())


@pytest.mark.root
@pytest.mark.bcc
@pytest.mark.slow
def test_auto_edge_mode_measures_the_paths_on_a_shaped_lan_and_runs_the_pick(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    path = tmp_path / "lan-shaped.toml"
    path.write_text(LAN_SCENARIO)
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "netstorm.cli", "emulate", str(path), "--system", "netstorm",
                           "--iterations", "2", "--model", "100k", "--edge-mode", "auto", "--lan-bw-scale", "0.5",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["systems"]["netstorm"]["exact"]
    assert any("per-worker LAN HTB rates x0.5" in a for a in result["features"]["applied"])
    calibration = result["features"]["edge_calibration"]["2"]
    assert calibration["workers"] == 2 and calibration["elements"] == 100_000
    from netstorm.lan.pathpick import Measured, pick

    measured = {p: Measured(calibration[p], calibration[p] is not None,
                            calibration.get(f"{p}_host_cpu_seconds_per_gb")) for p in ("xdp", "userspace", "tcp")}
    assert any(m.exact for m in measured.values()), calibration
    assert calibration["pick"] == pick(measured).path
    ran = result["features"]["edge_mode"]["netstorm"]["2"]
    assert ran.startswith(calibration["pick"])


@pytest.mark.root
def test_the_lan_bridge_skips_the_ip_netfilter_hooks() -> None:
    from netstorm.emulation.bridge_lan import BRIDGE_SYSCTLS, Lan

    with Lan(1) as lan:
        if Path("/proc/sys/net/bridge").exists():  # br_netfilter loaded: its hooks are off on this bridge
            out = netns.run(["ip", "netns", "exec", lan.bridge, "sysctl", *BRIDGE_SYSCTLS], what="read")
            assert all(f"{key} = 0" in out for key in BRIDGE_SYSCTLS)
        else:  # without br_netfilter no key exists and the bridge was built all the same
            assert netns.namespace_exists(lan.bridge)


REFLECT = r"""
#include <uapi/linux/bpf.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/udp.h>

/* Send UDP datagrams for port 9613 straight back where they came from with XDP_TX, as a two-level
   aggregator forwards its cluster's partial sums: addresses and ports swapped (checksums unchanged). */
int reflect(struct xdp_md *ctx) {
    void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
    struct ethhdr *eth = data;
    struct iphdr *ip = data + sizeof(*eth);
    struct udphdr *udp = (void *)ip + sizeof(*ip);
    if ((void *)(udp + 1) > end || eth->h_proto != htons(ETH_P_IP) || ip->ihl != 5 || ip->protocol != 17
        || udp->dest != htons(9613))
        return XDP_PASS;
    unsigned char mac[ETH_ALEN];
    __builtin_memcpy(mac, eth->h_dest, ETH_ALEN);
    __builtin_memcpy(eth->h_dest, eth->h_source, ETH_ALEN);
    __builtin_memcpy(eth->h_source, mac, ETH_ALEN);
    __be32 addr = ip->saddr; ip->saddr = ip->daddr; ip->daddr = addr;
    __be16 port = udp->source; udp->source = udp->dest; udp->dest = port;
    return XDP_TX;
}
"""
REFLECTED = 200
XDP_FLAGS_SKB_MODE = 2


@pytest.mark.root
@pytest.mark.bcc
@pytest.mark.parametrize("uplink", shaping.UPLINK_MODES)
def test_only_the_ifb_uplink_shapes_what_an_xdp_program_on_the_worker_transmits(uplink: str) -> None:
    """A worker's XDP program bounces datagrams back to the gateway (XDP_TX). Every one comes back; the
    uplink class counts them in ifb mode and not in veth mode, where XDP output skips the qdisc."""
    from bcc import BPF

    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.emulation.netns import run_in

    with Lan(1, rates=[(1.0, 1.0)], uplink=uplink) as lan:
        module = BPF(text=REFLECT.encode())
        fn = module.load_func(b"reflect", BPF.XDP)
        run_in(lan.workers[0], lambda: BPF.attach_xdp(b"eth0", fn, XDP_FLAGS_SKB_MODE))
        try:
            sock = lan.udp_socket(lan.gateway, GATEWAY_IP, 9614)
            sock.setblocking(True)
            sock.settimeout(DEADLINE_S)
            payload = b"\xab" * 1000
            got = 0
            for _ in range(REFLECTED):  # one at a time: nothing queues, nothing is dropped
                sock.sendto(payload, (lan.worker_ip(0), 9613))
                data, source = sock.recvfrom(2048)
                got += data == payload and source == (lan.worker_ip(0), 9613)
            sock.close()
        finally:
            run_in(lan.workers[0], lambda: BPF.remove_xdp(b"eth0", XDP_FLAGS_SKB_MODE))
        assert got == REFLECTED
        sent = shaping.read_classes(*lan.uplink_shaper(0))["1:1"].sent_packets
        if uplink == "ifb":
            assert sent >= REFLECTED
        else:
            assert sent < REFLECTED  # only the worker's own few packets (neighbour discovery) passed it


def test_root_drops_are_read_from_the_root_qdisc_only() -> None:
    text = ("qdisc htb 1: root refcnt 2 r2q 10 default 0x20 direct_packets_stat 0 direct_qlen 1000\n"
            " Sent 1234 bytes 10 pkt (dropped 7, overlimits 3 requeues 0)\n"
            " backlog 0b 0p requeues 0\n"
            "qdisc pfifo 8001: parent 1:20 limit 1000p\n"
            " Sent 1000 bytes 8 pkt (dropped 5, overlimits 0 requeues 0)\n")
    assert shaping.parse_root_drops(text) == 7
    assert shaping.parse_root_drops(text.split("qdisc pfifo")[0].replace("dropped 7", "dropped 0")) == 0
    assert shaping.parse_root_drops("") == 0


@pytest.mark.root
def test_a_shaped_port_that_overflows_shows_its_drops_and_an_ifb_uplink_queues_like_a_veth() -> None:
    """``Lan.drops`` reads drops from the kernel: a burst forwarded to a worker whose downlink is shaped to
    1 Mbit/s from many sockets overflows that port's queue. An ifb uplink
    device queues as many packets as a veth does."""
    import contextlib
    import subprocess

    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan

    with Lan(1, rates=[(0.001, 0.001)], uplink="ifb") as lan:
        qlen = {dev: subprocess.run(["ip", "-n", lan.bridge, "-o", "link", "show", dev], capture_output=True,
                                    text=True, check=True).stdout for dev in ("w0", lan.uplink_ifb(0))}
        assert all(f"qlen {shaping.IFB_QUEUE}" in text for text in qlen.values()), qlen
        # a socket's own packets stay charged to its send buffer until they leave the shaped port, so one
        # socket cannot overflow the queue; many sockets together can
        socks = [lan.udp_socket(lan.gateway, GATEWAY_IP) for _ in range(40)]
        for sock in socks:
            with contextlib.suppress(BlockingIOError):
                for _ in range(shaping.IFB_QUEUE):
                    sock.sendto(b"\x00" * 1000, (lan.worker_ip(0), 9))
        drops = lan.drops()
        for sock in socks:
            sock.close()
        assert drops["ports"]["w0"] > 0, drops
        assert drops["uplinks"]["w0"] == 0 and drops["ports"]["g"] == 0, drops
