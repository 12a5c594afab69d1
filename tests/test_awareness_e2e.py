"""Network awareness end to end, on HTB-shaped links between network namespaces.

* Real ``netstorm node`` processes whose clocks are skewed by hundreds of milliseconds
  (NETSTORM_CLOCK_SKEW) sync to the scheduler by SNTP over an unshaped management link, train with
  exact sums, and the scheduler's collector receives probe reports within 10 % of each direction's
  shaped rate (TCP goodput is about 95.6 % of the HTB rate at MTU 1500).
* In-process nodes (one thread and event loop per namespace) roll a new policy out every iteration
  while the next iteration's chunks already travel, with auxiliary paths taken as soon as the primary
  is busy: every auxiliary chunk that an intermediate node forwards while holding a newer policy than
  the chunk's still arrives, and every sum is exact (nothing lost, nothing counted twice).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import re
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

import netstorm
from netstorm.config import Config
from netstorm.netns_testbed import LinkSpec, Testbed
from netstorm.probe import LinkReport
from scheduler.collector import LinkCollector
from scheduler.service import SchedulerService

pytestmark = [pytest.mark.root, pytest.mark.slow]

STEP = 30.0  # seconds any one step may take
NETSTORM = str(Path(sys.executable).parent / "netstorm")


class RecordingCollector(LinkCollector):
    """The scheduler's collector, keeping every report it was given (the real one keeps the latest)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reports: list[LinkReport] = []
        self.changed = threading.Condition()

    def add(self, report: LinkReport, now: float) -> None:
        super().add(report, now)
        with self.changed:
            self.reports.append(report)
            self.changed.notify_all()

    def wait_for(self, links, count: int, timeout: float) -> list[LinkReport]:
        """Every report so far, once each of ``links`` has at least ``count`` (from any thread)."""
        def enough() -> bool:
            return all(sum(1 for r in self.reports if (r.src, r.dst) == link) >= count for link in links)
        with self.changed:
            assert self.changed.wait_for(enough, timeout), f"too few reports: {self.reports}"
            return list(self.reports)


@contextlib.asynccontextmanager
async def scheduler_in(tb: Testbed, node: int, rates, nodes, config: Config
                       ) -> AsyncIterator[tuple[SchedulerService, int]]:
    """A SchedulerService serving on every address of namespace ``node``; yields it and its port."""
    started: concurrent.futures.Future = concurrent.futures.Future()

    async def main() -> None:
        service = SchedulerService(rates, nodes, config)
        service.collector = RecordingCollector(rates, now=service.clock())
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(service.serve("0.0.0.0", 0, ready=lambda address: started.set_result(
                (service, address[1], loop, stop))))
            await stop.wait()
            task.cancel()

    finished = tb.run_in(node, main)
    service, port, loop, stop = await asyncio.wait_for(asyncio.wrap_future(started), STEP)
    try:
        yield service, port
    finally:
        loop.call_soon_threadsafe(stop.set)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.wrap_future(finished), STEP)


@contextlib.asynccontextmanager
async def node_process(tb: Testbed, ns: int, node_id: int, scheduler: str, listen: str, socket_path: Path,
                       skew: float, log_path: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """``netstorm node`` inside namespace ``ns`` with a skewed clock; stopped (and reaped) on exit."""
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", tb.names[ns], NETSTORM, "-v", "node", "--id", str(node_id),
            "--scheduler", scheduler, "--listen", listen, "--socket", str(socket_path),
            env={"NETSTORM_CLOCK_SKEW": str(skew), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def wait_for_line(path: Path, pattern: str, proc: asyncio.subprocess.Process) -> re.Match[str]:
    """The first match of ``pattern`` in a child's log, waiting on the file as it grows."""
    async with asyncio.timeout(STEP):
        while True:
            text = await asyncio.to_thread(path.read_text, errors="replace")
            match = re.search(pattern, text)
            if match:
                return match
            if proc.returncode is not None:
                raise AssertionError(f"node exited ({proc.returncode}):\n{text}")
            await asyncio.sleep(0.05)  # a log file offers nothing to wait on


def model(dc: int, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 * step + dc)
    return {"w": rng.integers(-1000, 1000, 2_000_000).astype(np.float32),
            "b": rng.integers(-1000, 1000, 100).astype(np.float32)}


SKEWED_RATES = {(1, 2): 40.0, (2, 1): 60.0}


def test_skewed_node_processes_measure_each_direction(tmp_path: Path) -> None:
    skews = {1: 0.35, 2: -0.45}
    config = Config(chunk_size=250_000, probe_chunk_size=500_000, probe_chunk_num=4, update_time=60.0,
                    connect_timeout=STEP, iteration_timeout=STEP)
    links = [LinkSpec(0, 1, SKEWED_RATES[(1, 2)], SKEWED_RATES[(2, 1)]),  # data: node 1 <-> node 2
             LinkSpec(0, 2, 1000.0, 1000.0), LinkSpec(1, 2, 1000.0, 1000.0)]  # management to the scheduler

    async def main() -> None:
        with Testbed(3, links) as tb:
            async with scheduler_in(tb, 2, SKEWED_RATES, [1, 2], config) as (service, port), \
                    node_process(tb, 0, 1, f"{tb.address(1, 2)}:{port}", f"{tb.address(0, 0)}:0",
                                 tmp_path / "n1.sock", skews[1], tmp_path / "n1.log") as p1, \
                    node_process(tb, 1, 2, f"{tb.address(2, 2)}:{port}", f"{tb.address(0, 1)}:0",
                                 tmp_path / "n2.sock", skews[2], tmp_path / "n2.log") as p2:
                offsets = {}
                for node_id, proc in ((1, p1), (2, p2)):
                    log = tmp_path / f"n{node_id}.log"
                    await wait_for_line(log, rf"node {node_id} serving", proc)
                    match = await wait_for_line(log, r"clock offset to the scheduler ([-+0-9.]+) s", proc)
                    offsets[node_id] = float(match.group(1))
                clients = {n: await netstorm.aconnect(tmp_path / f"n{n}.sock", timeout=STEP) for n in (1, 2)}
                try:
                    await asyncio.gather(*(kv.init(model(n, 0)) for n, kv in clients.items()))
                    for step in range(1, 4):
                        outs = await asyncio.gather(*(kv.push_pull(model(n, step)) for n, kv in clients.items()))
                        for out in outs:
                            for name in ("w", "b"):
                                np.testing.assert_array_equal(out[name], model(1, step)[name] + model(2, step)[name])
                finally:
                    for kv in clients.values():
                        await kv.close()
                collector = service.collector
                assert isinstance(collector, RecordingCollector)
                # Reports travel asynchronously: wait until each direction has at least three.
                reports = await asyncio.to_thread(collector.wait_for, SKEWED_RATES, 3, STEP)
        print(f"\n[skew] node clock skews {skews} s; SNTP offsets estimated {offsets} s")
        medians = {}
        for link, rate in SKEWED_RATES.items():
            got = [r.mbit_s for r in reports if (r.src, r.dst) == link]
            medians[link] = float(np.median(got))
            print(f"  link {link[0]}->{link[1]} shaped {rate} Mbit/s: reports (ratio) "
                  f"{', '.join(f'{v:.1f} ({v / rate:.3f})' for v in got)}; median {medians[link] / rate:.3f}")
            # Every report within 10 % of the shaped rate, and never above it (the shaper is a hard cap).
            assert all(v == pytest.approx(rate, rel=0.10) and v <= rate for v in got), (link, got)
        for node_id, skew in skews.items():
            assert offsets[node_id] == pytest.approx(-skew, abs=0.005)

    asyncio.run(main())
