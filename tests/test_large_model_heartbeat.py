"""A model of AlexNet's shapes (61.1 M parameters) on a 3-DC ``netstorm local`` cluster with the default
heartbeat options: init and two exact push_pulls, and no DC declared dead. Model-sized copies and sums
used to hold a node's event loop, which also sends its heartbeats, past ``heartbeat_timeout``; the second
iteration then failed. How long the iterations take is the size matrix's (``netstorm bench sizes``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

import netstorm
from netstorm import models
from netstorm.config import Config
from netstorm.local import LocalCluster
from scheduler import admin

pytestmark = pytest.mark.slow

NODES = [1, 2, 3]


def model(dc: int, step: int) -> dict[str, np.ndarray]:
    """Small integers, different per tensor, DC and step: every sum is exact in float32."""
    return {name: np.full(shape, (dc * (i + 3) + step) % 11 - 5, np.float32)
            for i, (name, shape) in enumerate(models.alexnet().tensors)}


def test_an_alexnet_sized_job_with_default_heartbeats_runs_exact_and_no_dc_is_declared_dead(
        tmp_path: Path) -> None:
    defaults = Config()
    assert (defaults.heartbeat_timeout, defaults.heartbeat_interval) == (5.0, 1.0)  # what this test is about

    async def main() -> None:
        run = tmp_path / "run"
        cluster = LocalCluster("internet2-9", NODES, run, scheduler_args=["--nodes", "1,2,3"],
                               common_args=["--iteration-timeout", "300"])
        async with cluster:
            assert cluster.scheduler_address is not None
            clients = {dc: await netstorm.aconnect(cluster.socket_path(dc), timeout=300) for dc in NODES}
            inits = await asyncio.gather(*(kv.init(model(dc, 0)) for dc, kv in clients.items()))
            first = model(1, 0)  # the lowest DC's model everywhere
            for got in inits:
                assert all(np.array_equal(got[name], value) for name, value in first.items())
            for step in (1, 2):
                results = await asyncio.gather(*(kv.push_pull(model(dc, step)) for dc, kv in clients.items()))
                parts = [model(dc, step) for dc in NODES]
                want = {name: parts[0][name] + parts[1][name] + parts[2][name] for name in first}
                for got in results:
                    assert all(np.array_equal(got[name], value) for name, value in want.items())
            status = await admin.status(cluster.scheduler_address, timeout=30)
            assert sorted(status.alive) == NODES
            for kv in clients.values():
                await kv.close()
        logs = {path.name: path.read_text() for path in run.glob("*.log")}
        for name, text in logs.items():
            assert "declared dead" not in text and "no heartbeat" not in text, name

    asyncio.run(main())
