"""DiLoCo over real NetStorm nodes on loopback (`netstorm local`-style processes): a Streaming DiLoCo
run of three DCs equals the single-process reference to float32 rounding (the trees sum in another
order), and a DC killed mid-run and restarted rejoins from the live DCs' state while the others never
stop: its digest agrees at the first sync it takes part in."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest

import netstorm
from netstorm.diloco.reference import simulate
from netstorm.diloco.schedule import Schedule
from netstorm.diloco.sync import DiLoCo
from netstorm.local import LocalCluster
from scheduler import admin
from tests.test_diloco import flat, initial, inner

pytestmark = pytest.mark.slow

NODES = [1, 2, 3]
TIMEOUT = 60.0
H, P, TAU = 4, 2, 1
COMMON = ["--chunk-size", "1000", "--iteration-timeout", "30", "--heartbeat-timeout", "2",
          "--heartbeat-interval", "0.2"]


def cluster(tmp_path: Path) -> LocalCluster:
    return LocalCluster("scale-5", NODES, tmp_path / "run", scheduler_args=["--nodes", "1,2,3"],
                        common_args=COMMON)


def test_streaming_diloco_over_netstorm_equals_the_reference(tmp_path: Path) -> None:
    steps = 6 * H + TAU

    def train(path: Path, dc: int) -> DiLoCo:
        kv = netstorm.connect(path, timeout=TIMEOUT)
        dl = DiLoCo(kv, initial(dc), sync_every=H, fragments=P, fragment_delay=TAU)
        for step in range(1, steps + 1):
            inner(dc - 1, step, dl.local)
            dl.step()
        dl.close()
        kv.close()
        return dl

    async def main() -> dict[int, DiLoCo]:
        async with cluster(tmp_path) as c:
            runs = await asyncio.gather(*(asyncio.to_thread(train, c.socket_path(dc), dc) for dc in NODES))
        return dict(zip(NODES, runs, strict=True))
    runs = asyncio.run(main())
    want, locals_ = simulate(flat(initial(1)), 3, inner, steps, Schedule(H, P, TAU))
    for i, dc in enumerate(NODES):
        assert runs[dc].digest() == runs[1].digest()  # bit-identical at every DC
        assert all(r.contributors == (1, 2, 3) and r.weight == 3 for r in runs[dc].records)
        # the nodes' trees sum three float32 values in their own order: 1e-6 relative covers the rounding
        np.testing.assert_allclose(runs[dc].state.params, want.params, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(runs[dc].local, locals_[i], rtol=1e-5, atol=1e-6)
    assert len(runs[1].records) == want.outer_steps == 6 * P


def test_a_killed_dc_rejoins_from_the_live_state_and_the_others_never_stop(tmp_path: Path) -> None:
    stop_after: list[int] = []
    three_synced = threading.Event()
    lock = threading.Lock()

    def survivor(path: Path, dc: int) -> DiLoCo:
        kv = netstorm.connect(path, timeout=TIMEOUT)
        dl = DiLoCo(kv, initial(dc), sync_every=H, fragments=P, fragment_delay=TAU)
        while True:
            inner(dc - 1, dl.steps + 1, dl.local)
            record = dl.step()
            with lock:
                done = bool(stop_after) and record is not None and record.index >= stop_after[0]
            if done:
                break
        dl.close()
        kv.close()
        return dl

    def doomed(path: Path) -> None:
        kv = netstorm.connect(path, timeout=TIMEOUT)
        dl = DiLoCo(kv, initial(3), sync_every=H, fragments=P, fragment_delay=TAU)
        while len(dl.records) < 3:
            inner(2, dl.steps + 1, dl.local)
            dl.step()
        three_synced.set()  # this trainer stops here; its node is killed next

    def joiner(path: Path) -> DiLoCo:
        kv = netstorm.connect(path, timeout=TIMEOUT)
        dl = DiLoCo(kv, {k: np.zeros_like(v) for k, v in initial(3).items()}, sync_every=H, fragments=P,
                    fragment_delay=TAU)
        assert dl.joined_at is not None
        first = dl.schedule.sync_index(dl.joined_at)
        with lock:
            stop_after.append(first + 4)
        while not (dl.records and dl.records[-1].index >= first + 4 and dl.in_flight() == 0):
            inner(2, dl.steps + 1, dl.local)
            dl.step()
        dl.close()
        kv.close()
        return dl

    async def main() -> tuple[DiLoCo, DiLoCo, DiLoCo]:
        async with cluster(tmp_path) as c:
            address = c.scheduler_address
            assert address is not None
            survivors = [asyncio.ensure_future(asyncio.to_thread(survivor, c.socket_path(dc), dc)) for dc in (1, 2)]
            dying = asyncio.ensure_future(asyncio.to_thread(doomed, c.socket_path(3)))
            await asyncio.wait_for(dying, TIMEOUT)
            assert three_synced.is_set()
            await c.kill("node-3")
            async with asyncio.timeout(TIMEOUT):
                while 3 in (await admin.status(address, timeout=10)).alive:  # noqa: ASYNC110 (another process)
                    await asyncio.sleep(0.1)
            c.socket_path(3).unlink(missing_ok=True)
            await c.restart("node-3")
            async with asyncio.timeout(TIMEOUT):
                while not c.socket_path(3).exists():  # noqa: ASYNC110 (another process's socket)
                    await asyncio.sleep(0.1)
            back = await asyncio.wait_for(asyncio.to_thread(joiner, c.socket_path(3)), TIMEOUT)
            one, two = await asyncio.wait_for(asyncio.gather(*survivors), TIMEOUT)
        return one, two, back
    one, two, back = asyncio.run(main())
    first = back.records[0]
    assert first.left_out and first.weight == 2
    theirs = {r.index: r for r in one.records}
    assert any(r.contributors == (1, 2) for r in one.records)  # rounds ran without DC 3 while it was down
    for r in back.records:  # from the first sync it takes part in, its digest is the survivors'
        assert r.digest == theirs[r.index].digest
        if r.index > first.index:
            assert theirs[r.index].contributors == (1, 2, 3) and theirs[r.index].weight == 3
    assert one.digest() == two.digest() == back.digest()
