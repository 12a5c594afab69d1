"""Passive uplink measurement at the gateway (netstorm/lan/uplinks.py, bpf/gateway.py): each worker's first window
of DATA per iteration becomes a burst, the meter takes the median of enough of them, and the gateway
reports the measured LAN when a rate moved past the threshold, no more often than the hold (fake clock)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bpf.gateway import EdgeOptions, GatewayRole
from netstorm import scenario
from netstorm.lan.uplinks import UplinkTracker
from netstorm.lan_scenario import LanSpec


def lan() -> LanSpec:
    spec = scenario.load("lan-planning").node(1).lan
    assert spec is not None
    return spec


def test_a_burst_is_the_first_window_of_a_worker_in_one_iteration() -> None:
    track = UplinkTracker(window=4, keep=2)
    for seq in range(8):                       # chunks past the window wait for ACKs: not counted
        track.on_data(0, 10, seq, 1000, now=1.0 + seq)
    track.on_data(1, 10, 2, 500, now=3.0)
    track.on_data(1, 10, 0, 500, now=2.5)      # arrival order is not sending order
    assert track.close(10) == [(0, 4000, 1.0, 4.0), (1, 1000, 2.5, 3.0)]
    assert track.close(10) == []


def test_the_tracker_holds_a_bounded_number_of_iterations() -> None:
    track = UplinkTracker(window=4, keep=2)
    for k in (1, 2, 3):
        track.on_data(0, k, 0, 100, now=float(k))
    track.on_data(0, 0, 0, 100, now=9.0)       # older than everything kept: ignored
    assert track.close(1) == []                # pushed out by iteration 3
    assert track.close(3) == [(0, 100, 3.0, 3.0)]
    assert track.close(2) == []                # closing 3 forgot 2


def test_the_gateway_reports_measured_uplinks_once_they_moved_and_then_at_most_once_per_hold() -> None:
    spec = lan()
    n = len(spec.workers)
    options = EdgeOptions(workers=n, listen=("127.0.0.1", 0), mode="userspace", lan=spec, report_change=0.2,
                          report_interval=10.0)
    role = GatewayRole(options, iteration_timeout=5.0)
    reports: list[LanSpec] = []
    role.on_measured = reports.append
    now = [0.0]
    role.clock = lambda: now[0]
    mb = 1_000_000
    slow = 1.0                                  # worker 0 achieves 1 Gbit/s: 1 MB in 8 ms
    role.agent = SimpleNamespace(downlink_bursts=lambda: [], uplink_bursts=lambda k: [
        (w, mb, 0.0, mb * 8 / ((slow if w == 0 else spec.workers[w].up_gbit) * 1e9)) for w in range(n)])  # type: ignore[assignment]
    for k in range(2):                          # the meter believes three bursts, not two
        role._measured(k)
    assert reports == []
    role._measured(2)
    assert len(reports) == 1
    assert reports[0].workers[0].up_gbit == pytest.approx(slow)
    assert [w.up_gbit for w in reports[0].workers[1:]] == pytest.approx([w.up_gbit for w in spec.workers[1:]])
    slow = 4.0 * spec.workers[0].up_gbit
    now[0] = 5.0
    for k in range(3, 8):                       # moved again, but within the hold
        role._measured(k)
    assert len(reports) == 1
    now[0] = 10.0
    role._measured(8)
    assert len(reports) == 2 and reports[1].workers[0].up_gbit == pytest.approx(slow)
