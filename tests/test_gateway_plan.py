"""A plan of the LAN tier reaches the gateway role and becomes its deployment: announced over real
loopback TCP, deployed before the tier starts, kept pending once it runs until the next released result
(and until its aggregators' services said HELLO), and exact sums in namespaces with the deployment a
planner chose."""

from __future__ import annotations

import asyncio
import dataclasses

import msgspec
import numpy as np
import pytest

from bpf.agent import EdgeAgent
from bpf.gateway import EdgeOptions, GatewayRole, topology_from_plan
from netstorm import lanreport, scenario
from netstorm.config import Config
from netstorm.control import LanPlan
from netstorm.errors import ConfigError
from netstorm.lan.deploy import LanTopology
from netstorm.lan_scenario import LanSpec
from scheduler.lanplanning import LanPlanning
from tests.test_scheduler_service import FAST, close_all, connect_all, run, scheduler


def _lan(name: str, dc: int) -> LanSpec:
    spec = scenario.load(name).node(dc).lan
    assert spec is not None
    return spec


LAN = _lan("lan-planning", 1)   # twelve workers: ALEPH clusters them


def _plan(spec: LanSpec, planner: str, node_id: int = 1) -> LanPlan:
    core = LanPlanning(Config(dc_planner=planner))
    core.report(lanreport.report_from_spec(node_id, spec))
    job = core.begin(node_id)
    message = core.finish(job, core.compute(job))
    assert message is not None
    return message


def _role(spec: LanSpec, *, plan_wait: float = 0.0) -> GatewayRole:
    return GatewayRole(EdgeOptions(workers=len(spec.workers), listen=("127.0.0.1", 0), mode="userspace", lan=spec,
                                   plan_wait=plan_wait), iteration_timeout=1.0)


def test_a_plan_becomes_the_topology_its_two_level_form_names() -> None:
    plan = _plan(LAN, "aleph")
    topology = topology_from_plan(plan, len(LAN.workers))
    clusters, direct = plan.two_level()
    assert topology.clusters == {a: tuple(m) for a, m in clusters.items()} and topology.levels == 2
    assert set(topology.unclustered) | set(topology.clusters) == set(direct)
    assert topology_from_plan(_plan(LAN, "flat"), len(LAN.workers)) == LanTopology(len(LAN.workers))
    with pytest.raises(ConfigError):   # a plan of a larger LAN
        topology_from_plan(plan, 4)


def test_the_scheduler_plan_pushed_to_a_gateway_changes_its_deployment() -> None:
    async def body() -> None:
        config = dataclasses.replace(FAST, dc_planner="aleph")
        async with scheduler(config) as service:
            clients = await connect_all(service)
            try:
                gateway = clients[0]
                # the wait ends when the plan comes; its deadline is for a scheduler planning on two busy
                # cores, where ALEPH's plan of twelve workers once took longer than 10 s
                role = _role(LAN, plan_wait=120.0)
                gateway.on_lan_plan(role.apply_lan_plan)
                report = role.announce(1)
                assert report is not None and lanreport.spec_from_report(report) == LAN
                gateway.report_lan(report)
                await role.wait_plan()   # what combine does before it starts the LAN tier
                assert role.plan is not None and role.plan.planner == "aleph"
                expected = topology_from_plan(service.lan.plans[1], len(LAN.workers))
                assert role.options.topology == expected and expected.levels == 2
                agent = role._start([1000, 24])
                try:
                    assert isinstance(agent, EdgeAgent)   # the UDP paths: the TCP one is one level
                    assert agent.topology == expected
                    for head, members in expected.clusters.items():   # what each aggregator learns at HELLO
                        told = agent.deployment(head, aggregator=True)
                        assert told is not None and told.members == members
                        for member in members:   # a member waits for its aggregator's HELLO
                            assert agent.deployment(member) is None
                    for worker in expected.unclustered:
                        told = agent.deployment(worker)
                        assert told is not None and told.send_to is None
                finally:
                    agent.sock.close()
            finally:
                await close_all(clients)

    run(body())


def test_a_plan_arriving_while_the_tier_runs_is_pending_until_the_next_released_result() -> None:
    role = _role(LAN)
    first = _plan(LAN, "aleph")
    role.apply_lan_plan(first)
    deployed = role.options.topology
    role.agent = object()  # type: ignore[assignment]   # the LAN tier runs
    other = msgspec.structs.replace(_plan(LAN, "pahina"), version=first.version + 1)
    assert topology_from_plan(other, len(LAN.workers)) != deployed
    role.apply_lan_plan(other)
    assert role.options.topology == deployed and role.plan is first and role.pending is other
    rates_only = msgspec.structs.replace(first, version=other.version + 1, rates=((0, 1.5),))
    role.apply_lan_plan(rates_only)   # the same deployment: taken at once, nothing pending
    assert role.plan is rates_only and role.pending is None and role.options.topology == deployed
    role.apply_lan_plan(first)   # older than the one deployed: ignored
    assert role.plan is rates_only


def test_a_pending_deployment_switches_at_a_release_once_its_aggregator_services_said_hello() -> None:
    """The switch happens at ``released(k)`` and only once every aggregator the plan names has a service: until
    then the plan stays pending (its members could not be told where to send) and nothing changes."""
    from netstorm.lan.header import Flag, Kind
    from netstorm.lan.packets import control_packet

    role = _role(LAN)
    role.apply_lan_plan(_plan(LAN, "flat"))
    agent = role._start([1000, 24])
    try:
        assert isinstance(agent, EdgeAgent) and agent.fallback is not None
        role.agent = agent
        planned = msgspec.structs.replace(_plan(LAN, "aleph"), version=5)
        topology = topology_from_plan(planned, len(LAN.workers))
        role.apply_lan_plan(planned)
        assert role.pending is planned and agent.epoch == 0
        role.released(7, [np.zeros(1000, np.float32), np.zeros(24, np.float32)], 13)
        assert role.pending is planned and agent.epoch == 0   # no service has said HELLO: it waits
        for i, head in enumerate(topology.clusters):   # each aggregator's service says HELLO
            hello = control_packet(Kind.HELLO, job=1, worker=head, iteration=1000 + i, flags=Flag.AGGREGATOR)
            agent.core.datagram(hello, ("127.0.0.1", 40000 + i), 0.0)
        role.released(8, [np.zeros(1000, np.float32), np.zeros(24, np.float32)], 13)
        assert role.pending is None and role.plan is planned and role.options.topology == topology
        assert agent.epoch == 1 and agent.deployments.since == 9 and agent.topology == topology
        # the aggregator in use expects the new contributors from the next iteration, under the new epoch
        assert agent.fallback.expected == topology.gateway_mask() and agent.fallback.epoch == 1
        assert agent.moved_sent == len(topology.clusters)   # every service is told
    finally:
        agent.sock.close()


def test_a_plan_for_another_lan_is_ignored_and_no_plan_means_the_configured_topology() -> None:
    role = _role(_lan("lan-hetero-4", 3))   # six workers
    role.apply_lan_plan(_plan(LAN, "aleph"))   # names workers up to 11
    assert role.plan is None and role.options.topology is None
    waiting = _role(_lan("lan-hetero-4", 3), plan_wait=0.05)

    async def wait() -> None:
        await waiting.wait_plan()   # gives up after plan_wait

    asyncio.run(wait())
    assert waiting.plan is None and waiting.options.topology is None
    with pytest.raises(ConfigError):
        EdgeOptions(workers=4, listen=("127.0.0.1", 0), mode="userspace", lan=LAN)


@pytest.mark.root
def test_sums_stay_exact_with_the_deployment_a_planner_chose() -> None:
    from tests.test_edge_levels import run_lan

    spec = _lan("lan-hetero-4", 3)   # six workers, ALEPH clusters five under worker 0
    role = _role(spec)
    role.apply_lan_plan(_plan(spec, "aleph"))
    topology = role.options.topology
    assert topology is not None and topology.levels == 2
    out = asyncio.run(run_lan("userspace", None, workers=len(spec.workers), iterations=3, topology=topology))
    assert out["checked"] == 3   # every iteration's sums equal the numpy reference (asserted inside)
    assert len(out["cluster_stats"]) == len(topology.clusters)   # the planned aggregator served its cluster
