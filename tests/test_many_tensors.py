"""A model of 20,000 small tensors on a 3-DC ``netstorm local`` cluster: one init and one exact push_pull,
and no DC declared dead on the way (registering used to block every node's loop past its heartbeats).
How long it takes is measured by ``netstorm bench layout --cluster 20000``, not asserted here.

The same cluster first gets a trainer with a wrong model on DC 1, before any other: it cannot capture the
job. The job's layout is the one a majority of DCs registers; the wrong trainer gets ``LayoutMismatch``
once that is decided, and a correct trainer on DC 1 then joins the job's first iteration. A scheduler given
the job's model refuses a wrong trainer at once, even the first of two DCs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import netstorm
from netstorm import cli
from netstorm.errors import LayoutMismatch
from netstorm.local import LocalCluster
from scheduler import admin

pytestmark = pytest.mark.slow

NODES = [1, 2, 3]
TENSORS = 20_000


def model(dc: int) -> dict[str, np.ndarray]:
    return {f"block{i:05d}.bias": np.full(3, dc * (i % 11) - i % 5, np.float32) for i in range(TENSORS)}


def test_init_of_20k_small_tensors_and_an_exact_push_pull_with_no_dc_declared_dead(tmp_path: Path) -> None:
    async def main() -> None:
        cluster = LocalCluster("internet2-9", NODES, tmp_path / "run", scheduler_args=["--nodes", "1,2,3"],
                               common_args=["--iteration-timeout", "120", "--heartbeat-interval", "0.5",
                                            "--heartbeat-timeout", "5"])
        async with cluster:
            assert cluster.scheduler_address is not None
            models = {dc: model(dc) for dc in NODES}
            wrong = await netstorm.aconnect(cluster.socket_path(1), timeout=300)
            early = asyncio.ensure_future(wrong.init({"other.weight": np.ones((5, 5), np.float32)}))
            clients = {dc: await netstorm.aconnect(cluster.socket_path(dc), timeout=300) for dc in NODES[1:]}
            later = {dc: asyncio.ensure_future(kv.init(models[dc])) for dc, kv in clients.items()}
            with pytest.raises(LayoutMismatch, match=r"node 1 has layout .* but the job's layout is"):
                await early  # refused once DCs 2 and 3 agreed (well before any timeout: the init round waits)
            await wrong.close()
            clients[1] = await netstorm.aconnect(cluster.socket_path(1), timeout=300)
            first = asyncio.ensure_future(clients[1].init(models[1]))
            inits = [await first, *[await later[dc] for dc in NODES[1:]]]
            for got in inits:  # node 1's values everywhere
                assert all(np.array_equal(got[name], value) for name, value in models[1].items())
            results = await asyncio.gather(*(kv.push_pull(models[dc]) for dc, kv in clients.items()))
            want = {name: models[1][name] + models[2][name] + models[3][name] for name in models[1]}
            for got in results:
                assert list(got) == list(want)
                assert all(np.array_equal(got[name], value) for name, value in want.items())
            status = await admin.status(cluster.scheduler_address, timeout=30)
            assert sorted(status.alive) == NODES
            assert all(kv.contributors == tuple(NODES) for kv in clients.values())
            clients = dict(sorted(clients.items()))
            for kv in clients.values():
                await kv.close()
        for dc in NODES:
            assert "is gone" not in (tmp_path / "run" / f"node-{dc}.log").read_text()

    asyncio.run(main())


def test_a_configured_model_refuses_a_wrong_first_trainer_of_two_dcs_at_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], record_property: Callable[[str, object], None]) -> None:
    """The scheduler given the job's model (``--layout-hash``, as ``netstorm layout-hash`` prints it for the
    model's arrays) refuses a wrong trainer at once, although it is first and a majority of two DCs would
    need both; the correct trainers then init and push_pull exactly."""
    models = {dc: {"w": np.full((40, 30), dc, np.float32), "b": np.arange(7, dtype=np.float32) * dc} for dc in (1, 2)}
    arrays: dict[str, Any] = dict(models[1])
    np.savez(tmp_path / "model.npz", **arrays)
    assert cli.main(["layout-hash", str(tmp_path / "model.npz"), "--chunk-size", "500"]) == 0
    layout_hash = capsys.readouterr().out.strip()

    async def main() -> None:
        cluster = LocalCluster("internet2-9", [1, 2], tmp_path / "run",
                               scheduler_args=["--nodes", "1,2", "--layout-hash", layout_hash],
                               common_args=["--iteration-timeout", "120", "--chunk-size", "500"])
        async with cluster:
            wrong = await netstorm.aconnect(cluster.socket_path(1), timeout=60)
            began = time.monotonic()
            with pytest.raises(LayoutMismatch, match=rf"layout is {layout_hash} \(the scheduler's layout_hash"):
                await wrong.init({"other.weight": np.ones((5, 5), np.float32)})
            record_property("layout_mismatch_after_s", round(time.monotonic() - began, 3))
            assert time.monotonic() - began < 20  # a pending vote would wait the 120 s iteration_timeout
            await wrong.close()
            clients = {dc: await netstorm.aconnect(cluster.socket_path(dc), timeout=60) for dc in (1, 2)}
            await asyncio.gather(*(kv.init(models[dc]) for dc, kv in clients.items()))
            results = await asyncio.gather(*(kv.push_pull(models[dc]) for dc, kv in clients.items()))
            for got in results:
                assert all(np.array_equal(got[n], models[1][n] + models[2][n]) for n in models[1])
            for kv in clients.values():
                await kv.close()

    asyncio.run(main())
