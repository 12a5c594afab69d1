"""Nothing outlives its process: after SIGKILL of a trainer or of a node, /dev/shm holds nothing of theirs
(a trainer's model memory is an anonymous memfd, or with NETSTORM_SHM=file a file its node unlinked once
mapped); a file a trainer left before its node mapped it is swept by the next one."""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import sys
from pathlib import Path

import pytest

from netstorm.local import LocalCluster

pytestmark = pytest.mark.slow

NODES = [1, 2]
TRAINER = """
import sys, numpy as np, netstorm
kv = netstorm.connect(sys.argv[1], timeout=120)
kv.init({"w": np.full((256, 256), float(sys.argv[2]), np.float32), "b": np.zeros(7, np.float32)})
print("INIT", flush=True)
sys.stdin.read()
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


def test_sigkill_of_a_trainer_or_a_node_after_init_leaves_nothing_in_dev_shm(tmp_path: Path) -> None:
    # what a trainer killed between making its file and its node mapping it left: the nodes sweep it
    dead = 2**22 + 777
    while Path(f"/proc/{dead}").exists():
        dead += 1
    left = Path(f"/dev/shm/netstorm-{dead}-leftover")
    left.write_bytes(b"\0" * 64)

    async def main() -> None:
        cluster = LocalCluster("internet2-9", NODES, tmp_path / "run", scheduler_args=["--nodes", "1,2"],
                               common_args=["--iteration-timeout", "60"], keep_going=True)
        async with cluster:
            assert not await asyncio.to_thread(left.exists)
            trainers = {}
            for dc, mode in ((1, "memfd"), (2, "file")):
                trainers[dc] = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", TRAINER, str(cluster.socket_path(dc)), str(dc),
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    env={**os.environ, "NETSTORM_SHM": mode})
            for dc, proc in trainers.items():
                assert proc.stdout is not None
                async with asyncio.timeout(120):
                    line = await proc.stdout.readline()
                assert line.strip() == b"INIT", (dc, line)
            node_pids = {dc: cluster.child(f"node-{dc}").process.pid for dc in NODES}
            # both sides hold the memory, and no name of it is left
            assert shm_of(*(p.pid for p in trainers.values())) == []
            assert all(mapped_shm(pid) == [] or all(m.endswith("(deleted)") for m in mapped_shm(pid))
                       for pid in node_pids.values())
            trainers[1].send_signal(signal.SIGKILL)
            await trainers[1].wait()
            assert shm_of(trainers[1].pid, node_pids[1]) == []
            await cluster.kill("node-2")
            assert shm_of(trainers[2].pid, node_pids[2]) == []
            trainers[2].send_signal(signal.SIGKILL)
            await trainers[2].wait()
            assert shm_of(*(p.pid for p in trainers.values()), *node_pids.values()) == []

    try:
        asyncio.run(main())
    finally:
        left.unlink(missing_ok=True)
