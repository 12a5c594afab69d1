"""A full disk under the scheduler's ``state_dir``, for real: the state directory is a 1 MiB tmpfs this
test mounts, filled to the last byte while the job runs. The job keeps running (every iteration gets
its policy, no node is declared dead), the store says it is behind, and once space returns the file
catches up: it then holds exactly the binding of every iteration the nodes were answered."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import os
import sqlite3
import subprocess
from pathlib import Path

import pytest
import uvloop

from scheduler.persistence import StateStore
from tests.dataplane import until
from tests.test_scheduler_service import FAST, T, close_all, connect_all
from tests.test_scheduler_service import scheduler as open_scheduler

pytestmark = pytest.mark.root
NODES = (1, 2)


def _fill(directory: Path) -> Path:
    """Write a file in ``directory`` until the file system refuses (ENOSPC); its path."""
    filler = directory / "filler"
    block = b"\xff" * 4096
    with open(filler, "wb", buffering=0) as file:
        while True:
            try:
                file.write(block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
    return filler


def test_a_full_state_disk_keeps_the_job_running_and_the_state_catches_up(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(state)], check=True)
    try:
        config = dataclasses.replace(FAST, state_dir=str(state))
        answered: dict[int, int] = {}

        async def main() -> None:
            async with open_scheduler(config, nodes=NODES) as service:
                store = service.store
                assert store is not None
                clients = await connect_all(service, NODES)
                try:
                    async def iteration(i: int) -> None:
                        versions = {p.version for p in await asyncio.gather(
                            *(c.policy_for(i, timeout=T) for c in clients))}
                        assert len(versions) == 1, versions
                        answered[i] = versions.pop()

                    for i in range(5):
                        await iteration(i)
                    filler = await asyncio.to_thread(_fill, state)
                    i = 5
                    while store.refused == 0:  # the WAL has room left for a few writes before it grows
                        assert i < 2000, "the full disk never refused a write"
                        await iteration(i)
                        i += 1
                    full_from = i
                    for _ in range(20):  # the job keeps running on a full disk
                        await iteration(i)
                        i += 1
                    assert store.behind
                    assert service.membership.alive == NODES and not any(c.lost for c in clients)
                    os.unlink(filler)  # space returns
                    await until(lambda: not store.behind, "the state caught up", T)
                    for _ in range(5):
                        await iteration(i)
                        i += 1
                    assert not store.behind
                    print(f"disk full from iteration {full_from} to {full_from + 20}, {store.refused} writes "
                          f"held back; the file caught up with {len(answered)} iterations")
                finally:
                    await close_all(clients)

        uvloop.run(main())
        reopened = StateStore.open(state, _job_of(state))
        try:
            saved = reopened.load()
        finally:
            reopened.close()
        assert {i: saved.bindings[i] for i in answered} == answered
        assert saved.complete and [r.node_id for r in saved.members] == list(NODES)
    finally:
        subprocess.run(["umount", "--lazy", str(state)], check=True)


def _job_of(state: Path) -> dict[str, object]:
    """The job identity the scheduler wrote (so the file opens as the same job's)."""
    db = sqlite3.connect(state / "scheduler.sqlite3")
    try:
        (identity,) = db.execute("SELECT value FROM job WHERE key = 'identity'").fetchone()
    finally:
        db.close()
    job = json.loads(identity)
    job.pop("schema")
    return dict(job)
