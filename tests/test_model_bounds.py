"""Size bounds before allocation: a trainer's init is refused against max_model_bytes and the memory free
before any shared memory exists, and its node refuses what exceeds its own bound before reading a byte."""

from __future__ import annotations

import asyncio
import glob
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import netstorm
from netstorm import client as client_module
from netstorm.client import Registry, sweep_shm
from netstorm.errors import ModelTooLarge
from tests.test_client import CONFIG, model, run_cluster


def _descends_from_us(pid: int) -> bool:
    """Whether ``pid`` is this process or one it started (tests run beside others that share /dev/shm)."""
    me = os.getpid()
    while pid > 1:
        if pid == me:
            return True
        try:
            with open(f"/proc/{pid}/stat") as fh:
                pid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def shm_files() -> set[str]:
    """This test's files in /dev/shm: those named for this process or its children."""
    out = set()
    for path in glob.glob("/dev/shm/netstorm-*"):
        owner = os.path.basename(path).split("-")[1]
        if owner.isdigit() and _descends_from_us(int(owner)):
            out.add(path)
    return out


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("mode", ["memfd", "file"])
def test_a_10e6_by_10e6_view_is_refused_before_anything_is_allocated(mode: str,
                                                                      record_property: Callable[[str, object], None]):
    huge = np.broadcast_to(np.float32(1.0), (10**6, 10**6))  # 4 TB of float32, no memory behind it
    before_files, before_fds = shm_files(), open_fds()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    registry = Registry(inline=False, shm=mode)
    start = time.perf_counter()
    with pytest.raises(ModelTooLarge, match=r"init of 1000000000003 elements .*exceeds max_model_bytes"):
        registry.prepare_init({"huge": huge, "bias": np.zeros(3, np.float32)})
    record_property("time_to_error_s", time.perf_counter() - start)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    record_property("peak_rss_growth_kib", grown_kib)
    assert grown_kib < 64 * 1024  # nothing of the model was touched
    assert registry.shm is None and registry.layout is None
    assert shm_files() == before_files and open_fds() == before_fds


def test_max_model_bytes_binds_at_its_value(monkeypatch: pytest.MonkeyPatch):
    tensors = {"w": np.zeros((10, 100), np.float32)}  # 4000 bytes
    monkeypatch.setenv("NETSTORM_MAX_MODEL_BYTES", "3999")
    with pytest.raises(ModelTooLarge, match="exceeds max_model_bytes = 3999"):
        Registry(inline=False).prepare_init(tensors)
    monkeypatch.setenv("NETSTORM_MAX_MODEL_BYTES", "4000")
    registry = Registry(inline=False)
    registry.prepare_init(tensors)
    registry.close()
    for inline in (False, True):  # over TCP the bound is the same (the payload is the model)
        with pytest.raises(ModelTooLarge):
            Registry(inline=inline, max_model_bytes=100).prepare_init(tensors)


def test_a_model_above_the_memory_free_is_refused(monkeypatch: pytest.MonkeyPatch):
    tensors = {"w": np.zeros((10, 100), np.float32)}
    monkeypatch.setattr(client_module, "memory_available", lambda: 3000)
    with pytest.raises(ModelTooLarge, match="only 3000 bytes are memory available"):
        Registry(inline=False).prepare_init(tensors)
    monkeypatch.setattr(client_module, "memory_available", lambda: 1 << 40)
    monkeypatch.setattr(client_module, "shm_free", lambda directory: 2000)
    with pytest.raises(ModelTooLarge, match="only 2000 bytes are space free in"):
        Registry(inline=False, shm="file").prepare_init(tensors)
    registry = Registry(inline=False, shm="memfd")  # a memfd is not bounded by /dev/shm's size
    registry.prepare_init(tensors)
    registry.close()


def test_the_node_refuses_a_model_above_its_own_bound_with_a_typed_error(tmp_path: Path):
    before = shm_files()

    async def body(addresses: dict[int, str]) -> None:
        for address in (addresses[1], addresses[2]):  # Unix socket (memfd) and TCP (inline)
            kv = await netstorm.aconnect(address, timeout=10)
            with pytest.raises(ModelTooLarge, match=r"node \d: init of 862 elements .* max_model_bytes = 1000"):
                await kv.init(model(1))
            await kv.close()

    run_cluster(tmp_path, body, CONFIG.replace(max_model_bytes=1000))
    assert shm_files() == before


def test_the_sweep_removes_files_of_dead_trainers_only(tmp_path: Path):
    dead = 2**22 + 12345  # above any pid the kernel hands out by default
    while Path(f"/proc/{dead}").exists():
        dead += 1
    orphan, mine, other = (tmp_path / f"netstorm-{dead}-abc", tmp_path / f"netstorm-{os.getpid()}-def",
                           tmp_path / "unrelated")
    for path in (orphan, mine, other):
        path.write_bytes(b"x")
    assert sweep_shm(str(tmp_path)) == [str(orphan)]
    assert not orphan.exists() and mine.exists() and other.exists()


def test_a_unix_init_leaves_no_file_in_dev_shm_while_it_runs(tmp_path: Path):
    before = shm_files()
    seen: list[set[str]] = []

    async def body(addresses: dict[int, str]) -> None:
        clients = {i: await netstorm.aconnect(addresses[i], timeout=20) for i in (1, 2, 3)}
        inits = [asyncio.ensure_future(kv.init(model(i))) for i, kv in clients.items()]
        await asyncio.sleep(0)
        seen.append(shm_files() - before)
        await asyncio.gather(*inits)
        seen.append(shm_files() - before)
        out = await asyncio.gather(*(kv.push_pull(model(10 + i)) for i, kv in clients.items()))
        want = {name: sum(model(10 + i)[name].astype(np.float32) for i in (1, 2, 3)) for name in model(1)}
        for got in out:
            for name, value in want.items():
                np.testing.assert_array_equal(got[name].astype(np.float32), value)
        for kv in clients.values():
            await kv.close()

    run_cluster(tmp_path, body)
    assert seen == [set(), set()]
