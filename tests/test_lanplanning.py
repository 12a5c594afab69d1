"""The scheduler plans each DC's LAN tier from its gateway's reports: the core, the passive meter, the
messages' validation, and a plan pushed to a node over real loopback TCP."""

from __future__ import annotations

import asyncio
import dataclasses

import msgspec
import pytest

from netstorm import control, lanreport, scenario
from netstorm.config import Config
from netstorm.control import ControlError, LanPlan
from netstorm.lan_scenario import LanSpec, LanWorker
from scheduler.lanplanning import LanPlanning
from tests.test_scheduler_service import FAST, T, close_all, connect_all, run, scheduler


def _lan(dc: int) -> LanSpec:
    spec = scenario.load("lan-planning").node(dc).lan
    assert spec is not None
    return spec


LAN = _lan(1)


def test_lan_report_round_trips_a_spec() -> None:
    racked = scenario.load("lan-planning").node(3).lan
    assert racked is not None
    for spec in (LAN, racked):
        report = lanreport.report_from_spec(7, spec)
        assert control.decode(control.encode(report)[4:]) == report
        assert lanreport.spec_from_report(report) == spec


@pytest.mark.parametrize("bad", [
    {"workers": [[1, 1.0, 1.0]]},  # not indexed from 0
    {"workers": [[0, 1.0, 1.0], [0, 1.0, 1.0]]},
    {"workers": [[0, 0.0, 1.0]]},  # a rate must be positive
    {"workers": [[0, 1.0, 1.0, 0.0, "fp64"]]},
    {"workers": [[0, 1.0, 1.0, 0.0, "fp32", 5]]},  # unknown rack
    {"workers": []},
])
def test_malformed_lan_reports_are_refused(bad: dict[str, object]) -> None:
    body = msgspec.msgpack.encode({"v": 1, "type": "lan_report", "node_id": 1, "gateway_gbit": 10.0, **bad})
    with pytest.raises(ControlError, match="lan_report"):
        control.decode(body)


def test_a_plan_places_every_worker_once() -> None:
    with pytest.raises(ValueError, match="placed twice"):
        LanPlan(node_id=1, version=0, planner="x", clusters=((0, (1,)), (2, (1,))), direct=(0, 2), rates=())
    with pytest.raises(ValueError, match="must send to the gateway"):
        LanPlan(node_id=1, version=0, planner="x", clusters=((0, (1,)),), direct=(), rates=())
    body = msgspec.msgpack.encode({"v": 1, "type": "lan_plan", "node_id": 1, "version": 0, "planner": "x",
                                   "clusters": [[0, [1]]], "direct": [0, 1], "rates": []})
    with pytest.raises(ControlError):
        control.decode(body)


def test_the_meter_believes_the_median_of_enough_bursts() -> None:
    meter = lanreport.LanRateMeter(LAN, window=5, min_samples=3)
    mb = 1_000_000
    meter.on_burst(0, "up", mb, 0.0, 0.001)  # 8 Gbit/s
    meter.on_burst(0, "up", mb, 0.0, 0.002)  # 4 Gbit/s
    assert meter.rate(0, "up") is None and meter.measured().workers[0] == LAN.workers[0]
    meter.on_burst(0, "up", mb, 0.0, 0.004)  # 2 Gbit/s
    meter.on_burst(0, "up", 100, 0.0, 0.004)  # too short to say anything
    assert meter.rate(0, "up") == pytest.approx(4.0)
    measured = meter.measured()
    assert measured.workers[0].up_gbit == pytest.approx(4.0)
    assert measured.workers[0].down_gbit == LAN.workers[0].down_gbit
    report = meter.report(3, t=1.0)
    assert report.measured and report.workers[0].up_gbit == pytest.approx(4.0)
    with pytest.raises(ValueError):
        meter.on_burst(0, "sideways", mb, 0.0, 1.0)


def _changed(spec: LanSpec, worker: int, factor: float) -> LanSpec:
    workers = list(spec.workers)
    workers[worker] = dataclasses.replace(workers[worker], up_gbit=workers[worker].up_gbit * factor)
    return dataclasses.replace(spec, workers=tuple(workers))


def test_core_replans_on_a_rate_change_past_the_threshold_only() -> None:
    core = LanPlanning(Config(dc_planner="aleph", dc_replan_change=0.2, dc_replan_hold=0.0))
    assert core.report(lanreport.report_from_spec(1, LAN))
    job = core.begin(1)
    assert not core.due(1)  # one plan at a time per DC
    first = core.finish(job, core.compute(job))
    assert first is not None and first.version == 0 and first.planner == "aleph"
    clusters, direct = first.two_level()
    placed = sorted([*direct, *(m for ms in clusters.values() for m in ms)])
    assert placed == list(range(len(LAN.workers)))
    assert not core.report(lanreport.report_from_spec(1, _changed(LAN, 3, 1.1), measured=True))
    assert core.report(lanreport.report_from_spec(1, _changed(LAN, 3, 0.5), measured=True))
    job = core.begin(1)
    second = core.finish(job, core.compute(job))
    assert second is not None and second.version == 1
    shape = dataclasses.replace(LAN, workers=(*LAN.workers, LanWorker(len(LAN.workers), 5.0, 5.0)))
    assert core.report(lanreport.report_from_spec(1, shape))  # a LAN of another shape


def test_measured_rates_replan_a_dc_at_most_once_per_hold_and_the_last_report_is_not_lost() -> None:
    core = LanPlanning(Config(dc_planner="aleph", dc_replan_change=0.2, dc_replan_hold=10.0))
    assert core.report(lanreport.report_from_spec(1, LAN), now=100.0)   # described: planned at once
    job = core.begin(1, now=100.0)
    assert core.finish(job, core.compute(job)) is not None
    assert core.next_deadline() is None
    slow = _changed(LAN, 3, 0.5)
    assert not core.report(lanreport.report_from_spec(1, slow, measured=True), now=103.0)
    assert core.next_deadline() == 110.0       # held until ten seconds after the last plan
    assert core.pending(109.9) == [] and core.pending(110.0) == [1]
    job = core.begin(1, now=110.0)
    assert job.spec == slow                    # the report made during the hold is the one planned
    assert core.finish(job, core.compute(job)) is not None and core.next_deadline() is None
    # it moves back within the hold: waits; a LAN of another shape (a description) does not
    assert not core.report(lanreport.report_from_spec(1, LAN, measured=True), now=111.0)
    shape = dataclasses.replace(LAN, workers=(*LAN.workers, LanWorker(len(LAN.workers), 5.0, 5.0)))
    assert core.report(lanreport.report_from_spec(1, shape), now=112.0)


def test_a_gateway_reports_its_measured_lan_when_it_moved_and_not_more_often_than_the_hold() -> None:
    schedule = lanreport.ReportSchedule(LAN, change=0.2, interval=10.0)
    assert not schedule.due(_changed(LAN, 2, 1.1), now=0.0)    # within the threshold of the description
    slow = _changed(LAN, 2, 0.5)
    assert schedule.due(slow, now=0.0)
    schedule.sent(slow, now=0.0)
    assert not schedule.due(_changed(LAN, 2, 2.0), now=5.0)    # moved, but within the interval
    assert schedule.due(_changed(LAN, 2, 2.0), now=10.0)
    assert not schedule.due(slow, now=20.0)                    # what was reported last


def test_core_plans_with_worker_aggregators_only() -> None:
    racked = scenario.load("lan-planning").node(3).lan
    assert racked is not None
    for planner in ("flat", "aleph", "pahina", "eina"):
        core = LanPlanning(Config(dc_planner=planner, dc_plan_time_limit=10.0))
        core.report(lanreport.report_from_spec(3, racked))
        job = core.begin(3)
        message = core.finish(job, core.compute(job))
        assert message is not None and message.planner == planner  # ToRs never reach the data plane


def test_a_failed_plan_keeps_the_previous_one_until_the_lan_changes() -> None:
    core = LanPlanning(Config(dc_planner="eina"))
    core.report(lanreport.report_from_spec(1, LAN))
    job = core.begin(1)
    assert core.finish(job, None, "solver crashed") is None
    assert not core.due(1) and core.plans == {}


def test_scheduler_pushes_a_plan_to_the_gateway_and_replans_on_a_measured_change() -> None:
    async def body() -> None:
        config = dataclasses.replace(FAST, dc_planner="aleph", dc_replan_hold=0.3)
        async with scheduler(config) as service:
            clients = await connect_all(service)
            try:
                gateway = clients[0]
                plans: asyncio.Queue[LanPlan] = asyncio.Queue()
                gateway.on_lan_plan(plans.put_nowait)
                gateway.report_lan(lanreport.report_from_spec(1, LAN))
                async with asyncio.timeout(T):
                    first = await plans.get()
                assert first.node_id == 1 and first.version == 0 and first.planner == "aleph"
                assert gateway.lan_plan == first and service.lan.plans[1] == first
                # measured within the hold: no report follows, the scheduler's timer plans it when the hold ends
                gateway.report_lan(lanreport.report_from_spec(1, _changed(LAN, 0, 0.3), measured=True))
                async with asyncio.timeout(T):
                    second = await plans.get()
                assert second.version == 1 and gateway.lan_plan == second
            finally:
                await close_all(clients)

    run(body())


def test_the_node_keeps_the_newest_plan_and_hands_it_to_a_gateway_role_that_takes_plans() -> None:
    from types import SimpleNamespace

    from node.service import GeneralNode

    taken: list[LanPlan] = []
    plan = LanPlan(node_id=1, version=3, planner="aleph", clusters=((0, (1,)),), direct=(0,),
                   rates=((0, 1.0), (1, 1.0)))
    node = SimpleNamespace(edge=SimpleNamespace(apply_lan_plan=taken.append), lan_plan=None)
    GeneralNode._lan_plan(node, plan)  # type: ignore[arg-type]
    assert node.lan_plan is plan and taken == [plan]
    bare = SimpleNamespace(edge=None, lan_plan=None)  # no gateway role (or one that takes no plans)
    GeneralNode._lan_plan(bare, plan)  # type: ignore[arg-type]
    assert bare.lan_plan is plan
