"""Downlink reports (netstorm/lan/downlink.py): a worker times its result burst up to its first PULL and
reports bytes and span in one authenticated REPORT; the schema refuses what it does not describe, the header
bounds the payload before it is decoded, the gateway keeps a bounded, replay-proof few per worker, takes a
report only with the worker's token for a collected iteration, and its meter reads them as downlinks."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from bpf.agent import EdgeAgent
from bpf.gateway import EdgeOptions, GatewayRole
from netstorm import scenario
from netstorm.lan.batch import valid_headers
from netstorm.lan.downlink import DownlinkReport, DownlinkReports, ResultTimer, parse_report, report_packet
from netstorm.lan.errors import WireError
from netstorm.lan.header import HEADER_BYTES, HEADER_DTYPE, MAX_REPORT_BYTES, Header, Kind
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import control_packet
from netstorm.lan.sums import IterationSums
from netstorm.lan.tokens import LanTokens
from netstorm.lan_scenario import LanSpec

LAYOUT = EdgeLayout.uniform([1000], scale=12, lanes=357)
JOB = 7
SECRET = b"downlink-secret"


def test_a_report_round_trips_and_the_schema_refuses_what_it_does_not_describe() -> None:
    report = DownlinkReport(nbytes=1_500_000, span_ns=12_000_000)
    data = report_packet(report, job=JOB, worker=3, iteration=41, token=99)
    head, back = parse_report(data)
    assert (head.kind, head.worker, head.iteration, head.token, back) == (Kind.REPORT, 3, 41, 99, report)
    bad = [msgspec.msgpack.encode({"nbytes": -1, "span_ns": 5}),
           msgspec.msgpack.encode({"nbytes": 1, "span_ns": 10**19}),
           msgspec.msgpack.encode({"nbytes": 1, "span_ns": 5, "t": 1.0}),
           msgspec.msgpack.encode({"nbytes": 1}),
           b"\xc1"]
    header = data[:HEADER_BYTES]
    for payload in bad:
        with pytest.raises(WireError, match="bad downlink report"):
            parse_report(header + payload)
    with pytest.raises(WireError, match="where a REPORT was expected"):
        parse_report(control_packet(Kind.PULL, job=JOB, worker=3, iteration=41))


def test_the_header_bounds_a_reports_payload_before_it_is_decoded() -> None:
    head = report_packet(DownlinkReport(1, 1), job=JOB, worker=0, iteration=1, token=0)[:HEADER_BYTES]
    fits, too_long = head + bytes(MAX_REPORT_BYTES), head + bytes(MAX_REPORT_BYTES + 1)
    assert Header.decode(fits).kind == Kind.REPORT
    with pytest.raises(WireError, match="REPORT datagram with"):
        Header.decode(too_long)
    rows = np.zeros(2, HEADER_DTYPE)
    rows[0] = np.frombuffer(head, HEADER_DTYPE)[0]
    rows[1] = rows[0]
    assert valid_headers(rows, np.array([len(fits), len(too_long)])).tolist() == [True, False]


def test_the_timer_spans_the_burst_until_the_first_pull_after_results_flowed() -> None:
    timer = ResultTimer()
    timer.start(5)
    timer.on_pull()                          # the probe while no result has arrived: not the end of the burst
    timer.on_results(1000, 10.0)
    timer.on_results(3000, 10.5)
    timer.on_pull()
    timer.on_results(7000, 20.0)             # a PULL's answers, after a pause: not the port's rate
    assert timer.report() == DownlinkReport(4000, 500_000_000)
    timer.start(6)
    assert timer.report() is None
    timer.on_results(4000, 11.0)             # all in one receive: no span to divide by
    assert timer.report() is None


def test_the_gateway_keeps_a_few_newer_reports_per_worker() -> None:
    kept = DownlinkReports(workers=2, keep=3)
    report = DownlinkReport(1000, 1_000_000)
    assert kept.on_report(0, 5, report)
    assert not kept.on_report(0, 5, report)       # the same iteration again (a replay): nothing
    assert not kept.on_report(0, 4, report)       # older
    assert not kept.on_report(2, 9, report)       # no such worker
    for k in range(6, 12):
        assert kept.on_report(0, k, DownlinkReport(1000 + k, 1_000_000))
    assert kept.on_report(1, 2**32 - 1, report) and kept.on_report(1, 0, report)   # iterations wrap
    bursts = kept.drain()
    assert [(w, n) for w, n, *_ in bursts] == [(0, 1009), (0, 1010), (0, 1011), (1, 1000), (1, 1000)]
    assert bursts[0][2:] == (0.0, pytest.approx(1e-3))
    assert kept.drain() == []


@pytest.fixture
def agent() -> Iterator[EdgeAgent]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    try:
        yield EdgeAgent(sock, LAYOUT, workers=2, job=JOB, mode="userspace", secret=SECRET)
    finally:
        sock.close()


def test_the_agent_takes_a_report_only_with_the_workers_token_for_a_collected_iteration(agent: EdgeAgent) -> None:
    tokens = LanTokens(SECRET, JOB)
    report = DownlinkReport(2_000_000, 16_000_000)
    agent.expect(3)
    agent.core.collected(3, IterationSums(LAYOUT, 3, 2, JOB))   # as a collect of it ends
    address = ("127.0.0.1", 5000)
    def say(iteration: int, token: int) -> None:
        agent.core.datagram(report_packet(report, job=JOB, worker=1, iteration=iteration, token=token), address, 0.0)

    say(4, tokens.worker(1, 4))
    with pytest.raises(WireError, match="wrong token"):
        say(3, tokens.worker(0, 3))
    assert agent.downlink_bursts() == []          # not collected yet, and forged
    say(3, tokens.worker(1, 3))
    assert agent.downlink_bursts() == [(1, 2_000_000, 0.0, pytest.approx(0.016))]
    assert agent.forged == 1 and agent.outbox.pending == 0     # never answered


def test_the_gateway_reports_measured_downlinks() -> None:
    spec = scenario.load("lan-planning").node(1).lan
    assert spec is not None
    n = len(spec.workers)
    role = GatewayRole(EdgeOptions(workers=n, listen=("127.0.0.1", 0), mode="userspace", lan=spec,
                                   report_change=0.2, report_interval=0.0), iteration_timeout=5.0)
    reports: list[LanSpec] = []
    role.on_measured = reports.append
    mb = 1_000_000
    slow = spec.workers[0].down_gbit / 4          # worker 0's results arrive at a quarter of its description
    role.agent = SimpleNamespace(  # type: ignore[assignment]
        uplink_bursts=lambda k: [],
        downlink_bursts=lambda: [(0, mb, 0.0, mb * 8 / (slow * 1e9))])
    for k in range(3):
        role._measured(k)
    assert len(reports) == 1
    assert reports[0].workers[0].down_gbit == pytest.approx(slow)
    assert [w.up_gbit for w in reports[0].workers] == [w.up_gbit for w in spec.workers]
