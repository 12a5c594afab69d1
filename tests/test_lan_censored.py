"""An uplink sample the gateway's own pacing bounds is censored: it shows a drop below the bound, never a
link at or above it (netstorm/lanreport.py), so a re-plan answers a changed link, not the pacing."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netstorm import lanreport
from netstorm.lan_scenario import LanSpec, LanWorker

CHANGE = 0.2
NBYTES = 1_000_000

LAN = LanSpec(tuple(LanWorker(i, up, 1.0, 0.1, "fp32") for i, up in enumerate((4.0, 1.0, 0.5, 2.0))), (), 8.0)


def _span(gbit: float) -> float:
    """Seconds a burst of NBYTES takes at ``gbit``."""
    return NBYTES * 8 / (gbit * 1e9)


def _feed(meter: lanreport.LanRateMeter, worker: int, rates: list[float], bound: float | None) -> None:
    for rate in rates:
        meter.on_burst(worker, "up", NBYTES, 0.0, _span(rate), bound)


@settings(max_examples=60, deadline=None)
@given(pace=st.floats(0.05, 3.5), ratios=st.lists(st.floats(1 - CHANGE + 1e-6, 1.5), min_size=1, max_size=20))
def test_samples_at_a_workers_pace_never_trigger_a_report(pace: float, ratios: list[float]) -> None:
    meter = lanreport.LanRateMeter(LAN, window=8, min_samples=3, margin=CHANGE)
    schedule = lanreport.ReportSchedule(LAN, CHANGE, 0.0)
    _feed(meter, 0, [pace * r for r in ratios], pace)
    # the link carried at least about its pace, below its described 4 Gbit/s: the description stands
    assert meter.measured() == LAN and not schedule.due(meter.measured(), 1.0)


def test_a_sample_clearly_below_the_pace_is_a_drop_and_is_reported() -> None:
    meter = lanreport.LanRateMeter(LAN, window=8, min_samples=3, margin=CHANGE)
    schedule = lanreport.ReportSchedule(LAN, CHANGE, 0.0)
    _feed(meter, 0, [2.0, 2.0, 2.0], 2.0)   # paced to 2 of its 4 Gbit/s: censored
    assert meter.rate(0, "up") is None and not schedule.due(meter.measured(), 1.0)
    _feed(meter, 0, [0.8, 0.8, 0.8], 2.0)   # 0.8 < 2 x (1 - 0.2): the link dropped
    assert meter.rate(0, "up") is None   # 3 of 6 samples censored: the median may still be "at least 2"
    _feed(meter, 0, [0.8], 2.0)
    assert meter.rate(0, "up") == pytest.approx(0.8)   # 4 of 7 measured: the median is a measured drop
    assert schedule.due(meter.measured(), 1.0)
    assert meter.measured().workers[0].up_gbit == pytest.approx(0.8)


def test_an_aggregator_bounded_by_its_members_is_not_reported_as_slow() -> None:
    clusters = {0: (1, 2, 3)}
    bounds = lanreport.uplink_bounds(LAN, clusters, {})
    assert bounds == {0: 0.5}   # its slowest member, worker 2, feeds it at 0.5 Gbit/s
    assert lanreport.uplink_bounds(LAN, clusters, {2: 0.3, 0: 0.2}) == {2: 0.3, 0: 0.2}   # its own pace is lower
    assert lanreport.uplink_bounds(LAN, clusters, {}, {2: 0.4})[0] == 0.4   # a member's believed rate counts
    meter = lanreport.LanRateMeter(LAN, window=8, min_samples=3, margin=CHANGE)
    schedule = lanreport.ReportSchedule(LAN, CHANGE, 0.0)
    _feed(meter, 0, [0.45, 0.5, 0.41, 0.48, 0.5], bounds[0])   # forwarded sums at the members' rate
    assert meter.measured() == LAN and not schedule.due(meter.measured(), 1.0)
    unbounded = lanreport.LanRateMeter(LAN, window=8, min_samples=3, margin=CHANGE)
    _feed(unbounded, 0, [0.45, 0.5, 0.41, 0.48, 0.5], None)   # what the meter said before: 4 -> 0.48
    assert schedule.due(unbounded.measured(), 1.0)


def test_a_censored_window_lifts_a_stale_drop_to_the_bound() -> None:
    meter = lanreport.LanRateMeter(LAN, window=4, min_samples=3, margin=CHANGE)
    _feed(meter, 1, [0.2, 0.2, 0.2], None)
    assert meter.rate(1, "up") == pytest.approx(0.2)
    _feed(meter, 1, [0.6], 0.6)   # now paced to 0.6 and keeping it: the link carries at least that
    assert meter.rate(1, "up") == pytest.approx(0.2)   # 1 of 4 censored: the median is still measured
    _feed(meter, 1, [0.6], 0.6)
    assert meter.rate(1, "up") == 0.6   # half the window says "at least 0.6": the stale drop is lifted


@settings(max_examples=60, deadline=None)
@given(rates=st.lists(st.floats(0.01, 10.0), min_size=0, max_size=20), window=st.integers(1, 8),
       min_samples=st.integers(1, 4))
def test_unpaced_samples_are_the_plain_median_of_the_window(rates: list[float], window: int,
                                                            min_samples: int) -> None:
    meter = lanreport.LanRateMeter(LAN, window=window, min_samples=min_samples, margin=CHANGE)
    _feed(meter, 3, rates, None)
    kept = [NBYTES * 8 / _span(r) / 1e9 for r in rates[-window:]]
    got = meter.rate(3, "up")
    if len(kept) < min_samples:
        assert got is None and meter.measured() == LAN
    else:
        assert got is not None and abs(got - statistics.median(kept)) <= 1e-9 * got
        assert meter.measured() == dataclasses.replace(LAN, workers=(*LAN.workers[:3], dataclasses.replace(
            LAN.workers[3], up_gbit=got)))


class _Bursts:
    """The agent as the gateway role's meter sees it: each iteration's uplink bursts, no downlink REPORTs."""

    def __init__(self, worker: int) -> None:
        self.worker = worker
        self.gbit = 0.0

    def uplink_bursts(self, iteration: int) -> list[tuple[int, int, float, float]]:
        return [(self.worker, NBYTES, 0.0, _span(self.gbit))]

    def downlink_bursts(self) -> list[tuple[int, int, float, float]]:
        return []


def _role(clusters: dict[int, tuple[int, ...]]) -> tuple[Any, _Bursts, list[LanSpec]]:
    from bpf.gateway import EdgeOptions, GatewayRole
    from netstorm.lan.deploy import LanTopology

    role = GatewayRole(EdgeOptions(workers=4, listen=("127.0.0.1", 0), mode="userspace", lan=LAN,
                                   topology=LanTopology(4, clusters), report_change=CHANGE, report_interval=0.0),
                       iteration_timeout=1.0)
    agent = _Bursts(0)
    setattr(role, "agent", agent)   # noqa: B010  (a stand-in for the agent, which mypy would refuse)
    reports: list[LanSpec] = []
    role.on_measured = reports.append
    return role, agent, reports


def test_the_gateway_role_bounds_a_cluster_aggregators_uplink_by_its_members() -> None:
    role, agent, reports = _role({0: (1, 2, 3)})   # worker 2's 0.5 Gbit/s bounds what 0 forwards
    agent.gbit = 0.49
    for k in range(1, 9):
        role._measured(k)
    assert reports == []
    agent.gbit = 0.1   # clearly below: aggregator 0's link (or its members' way to it) did drop
    for k in range(9, 14):
        role._measured(k)
    assert len(reports) == 1 and reports[0].workers[0].up_gbit == pytest.approx(0.1)
    flat, agent, reports = _role({})   # unclustered and unpaced: the same readings are the link's
    agent.gbit = 0.49
    for k in range(1, 4):
        flat._measured(k)
    assert len(reports) == 1 and reports[0].workers[0].up_gbit == pytest.approx(0.49)
