"""Prometheus metrics, structured logs and the status table: what operators see matches what the job did.

A scrape of a running 3-DC ``netstorm local`` job must count the iterations the trainers ran, the bytes
each link carried (the sender's count equals the receiver's and the trainers' WAN bytes), and the policy
version the scheduler published; the scheduler serves its gauges before any node registers.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import netstorm
from netstorm import logjson
from netstorm.cli import build_parser
from netstorm.commands import probe as probe_command
from netstorm.commands import status as status_command
from netstorm.config import Config
from netstorm.control import format_address
from netstorm.local import LocalCluster
from netstorm.metricserve import serve_metrics
from netstorm.scenario import load as load_scenario
from scheduler import admin
from scheduler.iterlog import IterationLog
from scheduler.metrics import renderer
from scheduler.service import SchedulerService

SCENARIO = """
name = "three"
[[node]]
id = 1
[[node]]
id = 2
[[node]]
id = 3
[[link]]
a = 1
b = 2
rate_mbit = 200
[[link]]
a = 1
b = 3
rate_mbit = 100
[[link]]
a = 2
b = 3
rate_mbit = 100
"""
NODES = [1, 2, 3]
TIMEOUT = 60.0
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(address: str) -> Samples:
    """Every sample at ``address``'s /metrics, keyed by (name, sorted labels)."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    out: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_the_scheduler_serves_its_gauges_before_any_node_registers() -> None:
    async def main() -> None:
        service = SchedulerService({(1, 2): 100.0, (2, 1): 100.0}, [1, 2], Config())
        server = await serve_metrics("127.0.0.1:0", renderer(service))
        port = server.sockets[0].getsockname()[1]
        try:
            samples = await scrape(f"127.0.0.1:{port}")
        finally:
            server.close()
        assert samples[("netstorm_policy_version", ())] == -1
        assert samples[("netstorm_members", (("state", "expected"),))] == 2
        assert samples[("netstorm_iterations_total", ())] == 0
        assert samples[("netstorm_link_believed_mbit", (("dst", "2"), ("src", "1")))] == 100.0

    asyncio.run(main())


def test_an_iteration_is_timed_by_its_slowest_dc_against_the_min_cut_of_its_policy() -> None:
    rates = {(1, 2): 100.0, (2, 1): 100.0, (1, 3): 50.0, (3, 1): 50.0, (2, 3): 50.0, (3, 2): 50.0}
    log = IterationLog({0: rates}.get)
    bound = {5: 0, 6: 0}.get
    log.record([(5, 1.0)], 12_500_000, bound)
    log.record([(5, 2.0), (6, 1.5)], 0, bound)
    # λ: node 3 receives 50 + 50 = 100 Mbit/s; 12.5 MB = 100 Mbit takes 1 s through it
    assert log.rows() == [(5, 0, 2.0, 1.0), (6, 0, 1.5, 1.0)]
    assert log.completed == 2 and log.seconds_total == 3.5


def test_json_logs_are_one_object_per_line() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logjson.JsonFormatter("node", 3))
    logger = logging.getLogger("netstorm.test-json")
    logger.addHandler(handler)
    try:
        logger.warning("link %d->%d lost: %s", 3, 1, 'said "bye"\nand left')
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["message"] == 'link 3->1 lost: said "bye"\nand left'
    assert (record["level"], record["logger"], record["role"], record["dc"]) == ("WARNING", logger.name, "node", 3)


def metrics_address(run_dir: Path, child: str) -> str:
    match = re.search(r"metrics at http://([\d.]+:\d+)/metrics", (run_dir / f"{child}.log").read_text())
    assert match, (run_dir / f"{child}.log").read_text()[-2000:]
    return match.group(1)


@pytest.mark.slow
def test_a_scrape_of_a_running_job_matches_what_it_did(tmp_path: Path) -> None:
    scenario = tmp_path / "three.toml"
    scenario.write_text(SCENARIO)
    run_dir = tmp_path / "run"
    rng = np.random.default_rng(7)
    model = {"w": rng.standard_normal(30_000).astype(np.float32), "b": rng.standard_normal(10).astype(np.float32)}

    async def main() -> None:
        cluster = LocalCluster(str(scenario), NODES, run_dir, metrics_listen="127.0.0.1:0", common_args=[
            "--chunk-size", "5000", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "5"])
        async with cluster:
            assert cluster.scheduler_address is not None
            clients = {dc: await netstorm.aconnect(cluster.socket_path(dc), timeout=TIMEOUT) for dc in NODES}
            wan = dict.fromkeys(NODES, 0)
            try:
                await asyncio.gather(*(kv.init(model) for kv in clients.values()))
                wan = {dc: kv.registry.wan_bytes for dc, kv in clients.items()}
                for step in range(4):
                    if step == 2:  # a new policy mid-run: the nodes' version must follow it
                        await admin.override_policy(cluster.scheduler_address, {
                            (a, b): 300.0 - r for (a, b), r in {(1, 2): 200.0, (2, 1): 200.0, (1, 3): 100.0,
                                                                (3, 1): 100.0, (2, 3): 100.0, (3, 2): 100.0}.items()},
                            timeout=TIMEOUT)
                    await asyncio.gather(*(kv.push_pull(model) for kv in clients.values()))
                    for dc, kv in clients.items():
                        wan[dc] += kv.registry.wan_bytes
                iterations = {kv.registry.iteration for kv in clients.values()}
                assert len(iterations) == 1
                last = iterations.pop()
                status = await admin.status(cluster.scheduler_address, timeout=TIMEOUT)
                nodes = {dc: await scrape(metrics_address(run_dir, f"node-{dc}")) for dc in NODES}
                scheduler_address = metrics_address(run_dir, "scheduler")
                deadline = asyncio.get_running_loop().time() + TIMEOUT
                while True:  # iteration times reach the scheduler with the heartbeats
                    scheduler = await scrape(scheduler_address)
                    if scheduler[("netstorm_iterations_total", ())] >= last + 1:
                        break
                    assert asyncio.get_running_loop().time() < deadline, scheduler
                    await asyncio.sleep(0.1)
                table = status_command.render(status_command.summary(
                    await admin.status(cluster.scheduler_address, timeout=TIMEOUT)))
                written = tmp_path / "measured.toml"
                probed = await asyncio.to_thread(probe_command.run, build_parser(only="probe")[0].parse_args(
                    ["probe", str(scenario), "--scheduler", format_address(cluster.scheduler_address),
                     "--out", str(written)]))
                final = await admin.status(cluster.scheduler_address, timeout=TIMEOUT)
            finally:
                for kv in clients.values():
                    await kv.close()

        bound = dict(status.bindings)
        assert scheduler[("netstorm_policy_version", ())] == status.version == bound[last] == 1
        assert scheduler[("netstorm_policy_publications_total", ())] == 2
        assert scheduler[("netstorm_replans_total", ())] == 1
        assert scheduler[("netstorm_iterations_total", ())] == last + 1
        assert scheduler[("netstorm_members", (("state", "alive"),))] == 3
        assert scheduler[("netstorm_iteration_limit_seconds", ())] > 0
        assert scheduler[("netstorm_model_bytes", ())] == 4 * 30_010
        for dc, samples in nodes.items():
            assert samples[("netstorm_iterations_total", ())] == last + 1, dc
            assert samples[("netstorm_policy_version", ())] == 1, dc
            sent = {int(dict(labels)["dst"]): value for (name, labels), value in samples.items()
                    if name == "netstorm_link_sent_bytes_total"}
            # the trainers' count is taken at each reply: result frames relayed after it come on top
            assert sum(sent.values()) >= wan[dc] > 0, (dc, sent, wan)
            for peer, nbytes in sent.items():  # what one end sent, the other received, to the byte
                key = ("netstorm_link_received_bytes_total", (("dst", str(peer)), ("src", str(dc))))
                assert nodes[peer][key] == nbytes, (dc, peer)
        # every push_pull sends each root's share of the model up and down its tree's n-1 edges, the init
        # (iteration 0) only down: the links carried at least that many models, frame headers on top
        total = sum(v for samples in nodes.values() for (name, _), v in samples.items()
                    if name == "netstorm_link_sent_bytes_total")
        assert total >= (2 * last + 1) * (len(NODES) - 1) * 4 * 30_010
        assert "x limit" in table and "believed Mbit/s" in table, table
        # netstorm probe of the running job: its links at the rates the nodes measured
        assert probed == 0
        believed = {(src, dst): (measured if measured >= 0 else belief)
                    for src, dst, belief, measured, _ in final.links}
        assert load_scenario(written).rates() == pytest.approx(believed, abs=1e-3)

    asyncio.run(main())
