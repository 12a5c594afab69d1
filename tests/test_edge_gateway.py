"""The gateway role end to end: a scheduler and two DC nodes (node 1 a gateway for two LAN workers on a
bridge), the gateway's own trainer, DC 2's trainer and both LAN workers in edge mode. Every participant
gets the same init values, the same exact sums and the same means over all four workers (the LAN
workers' push_pull is plain edge mode)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

import netstorm
from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
from netstorm.emulation.netns import run_in
from netstorm.lan.client import AsyncEdgeClient
from scheduler import admin

pytestmark = [pytest.mark.root, pytest.mark.slow]

EDGE_PORT = 9700
TIMEOUT = 60.0


def model(who: int, step: int) -> dict[str, np.ndarray]:
    """Integer-valued tensors, so every sum is exact whatever the order of additions."""
    rng = np.random.default_rng(100 * step + who)
    return {
        "a.weight": rng.integers(-50, 50, (30, 40)).astype(np.float32),
        "b.bias": rng.integers(-50, 50, (7,)).astype(np.float32),
        "c": rng.integers(-50, 50, (3, 500)).astype(np.float16),
    }


def poll(ready: Callable[[], bool], procs: list[subprocess.Popen[bytes]], timeout: float, what: str) -> None:
    """Until ``ready()`` (another process's file or listener: no event of ours to wait on), failing at once
    when one of ``procs`` exits and at ``timeout``."""
    deadline = time.monotonic() + timeout
    while not ready():
        for proc in procs:
            if proc.poll() is not None:
                raise AssertionError(f"{proc.args!r} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s")
        time.sleep(0.05)


def wait_for(path: Path, procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    poll(path.exists, procs, timeout, f"{path} did not appear")


def wait_listening(namespace: str, port: int, procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Until something accepts TCP on 127.0.0.1:``port`` inside ``namespace`` (the scheduler is up)."""
    def accepts() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return True
        except OSError:
            return False

    poll(lambda: run_in(namespace, accepts), procs, timeout, f"nothing listened on port {port} in {namespace}")


@contextlib.contextmanager
def gateway_job(tmp_path: Path, lan: Lan, mode: str, *, edge_port: int = EDGE_PORT, port_offset: int = 0,
                gateway_flags: Sequence[str] = (), iteration_timeout: float = 60,
                job_flags: Sequence[str] = ()) -> Iterator[int]:
    """A scheduler and two DC nodes in the gateway's namespace, node 1 the gateway of ``lan``'s two workers
    on ``edge_port`` (``mode``, plus ``gateway_flags``; both nodes fail an iteration after
    ``iteration_timeout`` seconds), until both trainer sockets exist; yields the
    scheduler's port. Their logs are shown if the body fails; every process is stopped (SIGTERM, then
    SIGKILL) on the way out."""
    cli = [sys.executable, "-m", "netstorm.cli", "-v"]   # INFO: the gateway's phase log
    inside = ["ip", "netns", "exec", lan.gateway]
    sched_port = 7000 + (os.getpid() + port_offset) % 1000
    common = ["--scheduler", f"127.0.0.1:{sched_port}", "--iteration-timeout", f"{iteration_timeout:g}", *job_flags]
    logs = [open(tmp_path / f"{name}.log", "wb") for name in ("scheduler", "node1", "node2")]  # noqa: SIM115
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(subprocess.Popen([*inside, *cli, "scheduler", "scale-5", "--nodes", "1,2", "--listen",
                                       f"127.0.0.1:{sched_port}", "--iteration-timeout", f"{iteration_timeout:g}",
                                       *job_flags],
                                      stdout=logs[0], stderr=subprocess.STDOUT))
        wait_listening(lan.gateway, sched_port, procs, timeout=30)
        procs.append(subprocess.Popen([*inside, *cli, "node", "--id", "1", *common, "--socket",
                                       str(tmp_path / "n1.sock"), "--edge-workers", "2", "--edge-listen",
                                       f"{GATEWAY_IP}:{edge_port}", "--edge-interface", "eth0", "--edge-mode",
                                       mode, *gateway_flags], stdout=logs[1], stderr=subprocess.STDOUT))
        procs.append(subprocess.Popen([*inside, *cli, "node", "--id", "2", *common, "--socket",
                                       str(tmp_path / "n2.sock")], stdout=logs[2], stderr=subprocess.STDOUT))
        for sock in ("n1.sock", "n2.sock"):
            wait_for(tmp_path / sock, procs, 60)
        yield sched_port
    except BaseException:
        for name in ("scheduler", "node1", "node2"):
            text = (tmp_path / f"{name}.log").read_bytes().decode(errors="replace")
            sys.stderr.write(f"--- {name}\n{text[-3000:]}")
        raise
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()


@pytest.mark.parametrize("chunk_size", [None, 400], ids=["whole-tensors", "tensors-in-parts"])
@pytest.mark.parametrize("mode", ["userspace", pytest.param("xdp", marks=pytest.mark.bcc)])
def test_lan_workers_and_dcs_agree_on_exact_sums(tmp_path: Path, mode: str, chunk_size: int | None) -> None:
    """With 400-element chunks and ``edge_overlap`` the two large tensors are WAN chunks in parts, each handed
    to the node as soon as the LAN summed it (``GatewayRole.combine_parts``): the sums stay exact."""
    job = [] if chunk_size is None else ["--chunk-size", str(chunk_size), "--edge-overlap", "true"]
    with Lan(2) as lan, gateway_job(tmp_path, lan, mode, job_flags=job) as sched_port:
        workers = [AsyncEdgeClient((GATEWAY_IP, EDGE_PORT), i, job=1, timeout=TIMEOUT,
                                   sock=lan.udp_socket(ns, lan.worker_ip(i)), group_opener=lan.group_opener(ns))
                   for i, ns in enumerate(lan.workers)]
        asyncio.run(_drive(tmp_path, workers))
        node_log = (tmp_path / "node1.log").read_bytes().decode(errors="replace")
        assert "gateway: 2 LAN workers" in node_log
        # the phase log names when the first part went up only where tensors were handed in parts
        assert ("first part went to the WAN step" in node_log) == (chunk_size is not None)
        # the gateway told the scheduler how it aggregates, and the admin interface says so
        status = run_in(lan.gateway, lambda: asyncio.run(admin.status(("127.0.0.1", sched_port), timeout=TIMEOUT)))
        assert set(status.edge) == {1}
        assert status.edge[1] == ("userspace", "") if mode == "userspace" else \
            status.edge[1] in (("xdp (native)", ""), ("xdp (generic)", ""))


async def _drive(tmp_path: Path, workers: list[AsyncEdgeClient]) -> None:
    gw = await netstorm.aconnect(str(tmp_path / "n1.sock"), timeout=TIMEOUT)
    dc2 = await netstorm.aconnect(str(tmp_path / "n2.sock"), timeout=TIMEOUT)
    try:
        inits = await asyncio.gather(gw.init(model(1, 0)), dc2.init(model(2, 0)),
                                     *(w.init(model(10 + w.worker_id, 0)) for w in workers))
        for got in inits:  # everyone starts from DC 1's values (the lowest id)
            for name, value in model(1, 0).items():
                np.testing.assert_array_equal(got[name], value)
        # every sum holds 4 workers' gradients: DC 1's trainer and its 2 LAN workers, and DC 2's trainer
        everyone: list[netstorm.AsyncClient | AsyncEdgeClient] = [gw, dc2, *workers]
        assert [kv.num_workers for kv in everyone] == [4, 4, 4, 4]
        for step in (1, 2, 3, 4, 5):
            average = step > 3
            inputs = [model(1, step), model(2, step), *(model(10 + w.worker_id, step) for w in workers)]
            outs = await asyncio.gather(*(kv.push_pull(x, average=average) for kv, x in zip(everyone, inputs,
                                                                                            strict=True)))
            for name in inputs[0]:
                total = np.sum([x[name].astype(np.float32) for x in inputs], axis=0)
                want = (total / np.float32(4) if average else total).astype(inputs[0][name].dtype)
                for who, out in enumerate(outs):
                    assert out[name].dtype == want.dtype and out[name].shape == want.shape
                    np.testing.assert_array_equal(out[name], want, err_msg=f"participant {who}, {name}, step {step}")
            assert [kv.num_workers for kv in everyone] == [4, 4, 4, 4]
    finally:
        await gw.close()
        await dc2.close()
        for w in workers:
            await w.close()
