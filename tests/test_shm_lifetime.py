"""Nothing outlives its process: after SIGKILL of a trainer or of a node, /dev/shm holds nothing of theirs
(a trainer's model memory is an anonymous memfd, or with NETSTORM_SHM=file a file its node unlinked once
mapped); a file a trainer left before its node mapped it is swept by the next one."""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from netstorm.local import LocalCluster

pytestmark = pytest.mark.slow

NODES = [1, 2]
TRAINER = """
import sys, time, numpy as np, netstorm
from netstorm.errors import TrainerError
dc = float(sys.argv[2])
model = {"w": np.full((256, 256), dc, np.float32), "b": np.full(7, dc, np.float32)}
kv = netstorm.connect(sys.argv[1], timeout=120)
kv.init(model)
print("INIT", flush=True)
for line in sys.stdin:
    if line.strip() == "push":  # a part of the next iteration only
        kv.push("b", model["b"])
        print("PUSHED", flush=True)
    elif line.strip() == "pp":
        start = time.monotonic()
        try:
            out = kv.push_pull(model)
            print("OK", float(out["w"][0, 0]), float(out["b"][0]), flush=True)
        except TrainerError as exc:
            print("ERR", type(exc).__name__, round(time.monotonic() - start, 3), str(exc).replace(chr(10), " "),
                  flush=True)
"""

def shm_of(*pids: int) -> list[str]:
    return [path for pid in pids for path in glob.glob(f"/dev/shm/netstorm-{pid}-*")]


def mapped_shm(pid: int) -> list[str]:
    """Files of /dev/shm the process maps (a node maps its trainers' model memory)."""
    try:
        return [line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                if "/dev/shm/netstorm-" in line]
    except OSError:
        return []


async def start_trainer(cluster: LocalCluster, dc: int, mode: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", TRAINER, str(cluster.socket_path(dc)), str(dc), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, env={**os.environ, "NETSTORM_SHM": mode})
    assert proc.stdout is not None
    async with asyncio.timeout(120):
        line = await proc.stdout.readline()
    assert line.strip() == b"INIT", (dc, line)
    return proc


async def command(proc: asyncio.subprocess.Process, what: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(what.encode() + b"\n")
    await proc.stdin.drain()
    async with asyncio.timeout(60):
        return (await proc.stdout.readline()).decode().strip()


def test_sigkill_of_a_trainer_or_a_node_after_init_leaves_nothing_in_dev_shm(
        tmp_path: Path, record_property: Callable[[str, object], None]) -> None:
    """Also: DC 1's trainer killed in the middle of an iteration fails it for DC 2 at once (``PeerLost``
    well before iteration_timeout), and a replacement on DC 1 continues with exact sums; killed between
    iterations, DC 2's next iteration fails as soon as DC 2 starts it, and the replacement's is exact."""
    # what a trainer killed between making its file and its node mapping it left: the nodes sweep it
    dead = 2**22 + 777
    while Path(f"/proc/{dead}").exists():
        dead += 1
    left = Path(f"/dev/shm/netstorm-{dead}-leftover")
    left.write_bytes(b"\0" * 64)

    async def main() -> None:
        # one root: one of the DCs is a leaf, which no chunk reaches before its own part is in
        cluster = LocalCluster("internet2-9", NODES, tmp_path / "run",
                               scheduler_args=["--nodes", "1,2", "--num-root-servers", "1"],
                               common_args=["--iteration-timeout", "60", "--chunk-size", "1000"], keep_going=True)
        async with cluster:
            assert not await asyncio.to_thread(left.exists)
            starting = [start_trainer(cluster, dc, mode) for dc, mode in ((1, "memfd"), (2, "file"))]
            trainers = dict(zip(NODES, await asyncio.gather(*starting), strict=True))
            node_pids = {dc: cluster.child(f"node-{dc}").process.pid for dc in NODES}
            # both sides hold the memory, and no name of it is left
            assert shm_of(*(p.pid for p in trainers.values())) == []
            assert all(mapped_shm(pid) == [] or all(m.endswith("(deleted)") for m in mapped_shm(pid))
                       for pid in node_pids.values())
            # DC 1's trainer pushes part of iteration 1, DC 2's is waiting in it; DC 1's is killed
            assert await command(trainers[1], "push") == "PUSHED"
            waiting = asyncio.ensure_future(command(trainers[2], "pp"))
            trainers[1].send_signal(signal.SIGKILL)
            await trainers[1].wait()
            assert shm_of(trainers[1].pid, node_pids[1]) == []
            outcome = (await waiting).split(" ", 3)
            assert outcome[:2] == ["ERR", "PeerLost"] and "iteration 1" in outcome[3], outcome
            record_property("peer_lost_after_s", float(outcome[2]))
            assert float(outcome[2]) < 20  # iteration_timeout is 60 s
            # a replacement on DC 1 inits at once and the next iteration is exact
            trainers[1] = await start_trainer(cluster, 1, "memfd")
            both = await asyncio.gather(command(trainers[1], "pp"), command(trainers[2], "pp"))
            assert both == ["OK 3.0 3.0", "OK 3.0 3.0"], both
            # killed between iterations, before anything of the next one reached DC 1: DC 2's next
            # iteration fails as soon as it starts, and a replacement's next is exact again
            trainers[1].send_signal(signal.SIGKILL)
            await trainers[1].wait()
            outcome = (await command(trainers[2], "pp")).split(" ", 3)
            assert outcome[:2] == ["ERR", "PeerLost"] and "node 1" in outcome[3], outcome
            record_property("peer_lost_before_anything_s", float(outcome[2]))
            assert float(outcome[2]) < 5  # iteration_timeout is 60 s
            trainers[1] = await start_trainer(cluster, 1, "memfd")
            both = await asyncio.gather(command(trainers[1], "pp"), command(trainers[2], "pp"))
            assert both == ["OK 3.0 3.0", "OK 3.0 3.0"], both
            await cluster.kill("node-2")
            assert shm_of(trainers[2].pid, node_pids[2]) == []
            trainers[2].send_signal(signal.SIGKILL)
            await trainers[2].wait()
            assert shm_of(*(p.pid for p in trainers.values()), *node_pids.values()) == []

    try:
        asyncio.run(main())
    finally:
        left.unlink(missing_ok=True)
