"""``netstorm scheduler`` as a process: control TCP and SNTP on one port, registration, clean SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from netstorm.clock import Clock
from netstorm.commands.scheduler import parse_nodes
from netstorm.control import parse_address
from netstorm.errors import ConfigError
from netstorm.scenario import PRIOR_MBIT, load
from node.control_client import SchedulerClient
from scheduler import admin

T = 30.0


def start_scheduler(*args: str) -> tuple[subprocess.Popen[str], tuple[str, int]]:
    proc = subprocess.Popen([sys.executable, "-m", "netstorm.cli", "scheduler", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the process prints its address first, or exits
    if not line.startswith("scheduler listening on "):
        proc.kill()
        raise AssertionError(f"unexpected first line {line!r}; stderr: {proc.communicate()[1]}")
    return proc, parse_address(line.split()[3])


@pytest.mark.slow
def test_scheduler_process_serves_control_and_sntp_on_one_port_and_stops_on_sigterm() -> None:
    proc, address = start_scheduler("internet2-9", "--listen", "127.0.0.1:0", "--nodes", "1,2,3",
                                    "--bw-scale", "0.25", "--chunk-size", "4096")
    try:
        async def main() -> None:
            skewed = Clock(skew=0.4)
            offset = await skewed.sync(*address, timeout=T)
            assert abs(offset + 0.4) < 0.05, offset
            clients = await asyncio.gather(*(
                SchedulerClient.connect(address, n, ("127.0.0.1", 41000 + n), timeout=T) for n in (1, 2, 3)))
            try:
                assert clients[0].config.chunk_size == 4096
                policies = await asyncio.gather(*(c.policy_for(0, timeout=T) for c in clients))
                assert len({p.version for p in policies}) == 1 and set(policies[0].nodes) == {1, 2, 3}
                status = await admin.status(address, timeout=T)
                assert status.complete and status.expected == (1, 2, 3)
            finally:
                for c in clients:
                    await c.close()

        asyncio.run(main())
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=T)
    assert proc.returncode == 0, err
    assert "scheduler stopped" in err


def test_parse_nodes_names_unknown_ids() -> None:
    scenario = load("internet2-9")
    assert parse_nodes("3,1", scenario) == [1, 3]
    assert parse_nodes(None, scenario) == list(range(1, 10))
    with pytest.raises(ConfigError, match=r"unknown node\(s\) \[12\]"):
        parse_nodes("1,12", scenario)
    with pytest.raises(ConfigError, match="comma-separated integers"):
        parse_nodes("1,x", scenario)


def test_the_cli_builds_only_the_command_it_runs() -> None:
    from netstorm import cli

    _, modules = cli.build_parser(only="scheduler")
    assert set(modules) == {"scheduler"}
    _, everything = cli.build_parser()
    assert {"scheduler", "local", "node"} <= set(everything)
    with pytest.raises(SystemExit) as info:
        cli.main(["-v", "no-such-command"])
    assert info.value.code == 2


@pytest.mark.slow
def test_a_scheduler_on_a_scenario_without_rates_plans_from_its_nodes_probes(tmp_path: Path) -> None:
    """Three DCs and no links (a full mesh to be measured): the nodes probe every link before the first
    policy, which plans from what they measured."""
    bare = tmp_path / "bare.toml"
    bare.write_text('name = "bare"\n' + "".join(f"[[node]]\nid = {n}\n" for n in (1, 2, 3)))
    proc, address = start_scheduler(str(bare), "--listen", "127.0.0.1:0", "--probe-bytes", "1000000")
    try:
        async def main() -> None:
            clients = await asyncio.gather(*(
                SchedulerClient.connect(address, n, ("127.0.0.1", 41000 + n), timeout=T, probe_host="127.0.0.1")
                for n in (1, 2, 3)))
            try:
                policy = await clients[0].policy_for(0, timeout=T)
                assert sorted(policy.rates) == [(a, b) for a in (1, 2, 3) for b in (1, 2, 3) if a != b]
                assert PRIOR_MBIT not in policy.rates.values()  # each is a probe's, none the prior
                status = await admin.status(address, timeout=T)
                assert {(src, dst): believed for src, dst, believed, _, _ in status.links} == policy.rates
            finally:
                for c in clients:
                    await c.close()

        asyncio.run(main())
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=T)
    assert proc.returncode == 0, err
    assert "its nodes probe them (1000000 bytes each)" in err
