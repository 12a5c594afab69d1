"""DCs and the scheduler come back, on loopback: `netstorm local`-style processes killed and restarted.

A three-DC cluster trains (every step, each trainer adds the step's exact sum to its model, so the live
model changes), loses DC 3 (SIGKILL), goes on with two, takes DC 3 back (the same command line): its
trainer's init returns the model the live trainers hold now and the next sums are exact over all three.
Then the scheduler is killed: an iteration already bound completes without it, and once it is restarted
(same command line, same ``--state-dir``) the nodes re-attach and the job goes on with the same versions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest

import netstorm
from netstorm.aclient import AsyncClient
from netstorm.errors import TrainerError
from netstorm.local import LocalCluster
from scheduler import admin

pytestmark = pytest.mark.slow

NODES = [1, 2, 3]
TIMEOUT = 60.0


def gradient(dc: int, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 * step + dc)
    return {"w": rng.integers(-50, 50, (40, 100)).astype(np.float32),
            "b": rng.integers(-50, 50, (7,)).astype(np.float32)}


def exact(step: int, dcs: list[int]) -> dict[str, np.ndarray]:
    return {name: np.sum([gradient(dc, step)[name] for dc in dcs], axis=0) for name in ("w", "b")}


async def until(predicate_coro: Callable[[], Awaitable[bool]], what: str, seconds: float = 30.0) -> None:
    """Poll ``predicate_coro()`` (the scheduler pushes nothing to admin clients) within a deadline."""
    async with asyncio.timeout(seconds):
        while not await predicate_coro():  # noqa: ASYNC110 (a separate process: no event to await)
            await asyncio.sleep(0.1)


async def step_all(clients: dict[int, AsyncClient], params: dict[int, dict[str, np.ndarray]],
                   step: int) -> None:
    """One exact iteration over ``clients``; each trainer applies the sum to its model in place. Every
    trainer's attempt ends before a failure is raised (so a retry starts them all at the same step)."""
    outcomes = await asyncio.gather(*(kv.push_pull(gradient(dc, step)) for dc, kv in clients.items()),
                                    return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    results = [outcome for outcome in outcomes if not isinstance(outcome, BaseException)]
    want = exact(step, sorted(clients))
    for dc, got in zip(clients, results, strict=True):
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value, err_msg=f"DC {dc}, step {step}")
            params[dc][name] += got[name]


def test_a_killed_dc_rejoins_with_the_live_model_and_the_job_survives_a_scheduler_restart(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"

    async def main() -> None:
        cluster = LocalCluster("scale-5", NODES, run_dir,
                               scheduler_args=["--nodes", "1,2,3", "--state-dir", str(tmp_path / "state")],
                               common_args=["--chunk-size", "1000", "--iteration-timeout", "30",
                                            "--heartbeat-timeout", "2", "--heartbeat-interval", "0.2",
                                            "--scheduler-grace", "60"])
        async with cluster:
            address = cluster.scheduler_address
            assert address is not None
            clients = {dc: await netstorm.aconnect(cluster.socket_path(dc), timeout=TIMEOUT) for dc in NODES}
            try:
                inits = await asyncio.gather(*(kv.init({"w": np.full((40, 100), dc, np.float32),
                                                        "b": np.full(7, dc, np.float32)})
                                               for dc, kv in clients.items()))
                params = {dc: got for dc, got in zip(clients, inits, strict=True)}
                for step in (1, 2):
                    await step_all(clients, params, step)

                # DC 3 dies between iterations; the survivors go on once the scheduler re-planned without it.
                await cluster.kill("node-3")
                await clients.pop(3).close()
                del params[3]

                async def three_gone() -> bool:
                    status = await admin.status(address, timeout=10)
                    return 3 not in status.alive and 3 not in (await admin.fetch_policy(address, -1, timeout=10)).nodes
                await until(three_gone, "node 3 declared dead and planned out")
                step = 3
                for _attempt in range(3):  # an iteration bound before the re-plan fails, naming node 3
                    try:
                        await step_all(clients, params, step)
                        break
                    except TrainerError as exc:
                        assert "node 3" in str(exc), exc
                step += 1
                await step_all(clients, params, step)

                # DC 3 comes back with its original command line; its trainer starts from other values.
                cluster.socket_path(3).unlink(missing_ok=True)
                await cluster.restart("node-3")
                await until(lambda: asyncio.to_thread(cluster.socket_path(3).exists), "node 3's trainer socket")
                kv3 = await netstorm.aconnect(cluster.socket_path(3), timeout=TIMEOUT)
                clients[3] = kv3
                init3 = asyncio.ensure_future(kv3.init({"w": np.zeros((40, 100), np.float32),
                                                        "b": np.zeros(7, np.float32)}))

                async def three_admitted() -> bool:
                    return 3 in (await admin.status(address, timeout=10)).alive
                await until(three_admitted, "node 3 admitted")
                # The boundary is the first iteration not yet bound when it was admitted: the survivors
                # may first complete one bound before (without DC 3). The push that starts the boundary
                # hands DC 3 the provider's model as it is then, and waits for DC 3's own push.
                while True:
                    step += 1
                    live = {name: value.copy() for name, value in params[1].items()}
                    survivors = asyncio.ensure_future(asyncio.gather(
                        *(clients[dc].push_pull(gradient(dc, step)) for dc in (1, 2))))
                    await asyncio.wait({survivors, init3}, timeout=TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
                    if not survivors.done():
                        break
                    assert clients[1].num_workers == 2
                    for dc, result in zip((1, 2), survivors.result(), strict=True):
                        for name, value in exact(step, [1, 2]).items():
                            np.testing.assert_array_equal(result[name], value)
                            params[dc][name] += result[name]
                got = await init3
                for name, value in live.items():  # the model the live trainers hold, not node 3's zeros
                    np.testing.assert_array_equal(got[name], value, err_msg=name)
                params[3] = got
                mine = await kv3.push_pull(gradient(3, step))
                theirs = await survivors
                want = exact(step, NODES)
                for dc, result in zip((1, 2, 3), [*theirs, mine], strict=True):
                    for name, value in want.items():
                        np.testing.assert_array_equal(result[name], value, err_msg=f"DC {dc} after rejoining")
                        params[dc][name] += result[name]
                # the newest iteration bound before this step: at most this step's own (prefetched)
                bound = max((i for i, _ in (await admin.status(address, timeout=10)).bindings), default=-1)
                step += 1
                await step_all(clients, params, step)

                # The scheduler dies: the iteration already bound (prefetched) completes without it. Each node
                # asks for the next iteration's policy once this one completes there, in the background: the
                # kill waits until that ask has bound it, so what is tested is the run without the scheduler,
                # not a race of the prefetch against the kill on a loaded host.
                async def next_bound() -> bool:
                    status = await admin.status(address, timeout=2)
                    return any(i > bound for i, _ in status.bindings)
                await until(next_bound, "the next iteration bound by the nodes' prefetch")
                before = await admin.status(address, timeout=10)
                await cluster.kill("scheduler")
                step += 1
                await step_all(clients, params, step)
                await cluster.restart("scheduler")

                async def resumed() -> bool:
                    try:
                        status = await admin.status(address, timeout=2)
                    except Exception:
                        return False
                    return status.complete and set(status.alive) == set(NODES)
                await until(resumed, "scheduler resumed")
                after = await admin.status(address, timeout=10)
                assert after.version == before.version
                assert set(before.bindings) <= set(after.bindings)  # no bound iteration was bound again
                for _ in range(2):
                    step += 1
                    await step_all(clients, params, step)
                for dc in (2, 3):  # every DC's model is the same after all of this
                    for name in ("w", "b"):
                        np.testing.assert_array_equal(params[dc][name], params[1][name])
            finally:
                for kv in clients.values():
                    await kv.close()

    asyncio.run(main())
