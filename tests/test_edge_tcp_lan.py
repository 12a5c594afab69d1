"""The TCP path (``edge_mode=tcp``) on a namespace LAN: a gateway and 2-8 workers on a bridge, exact sums
over many iterations at mixed precisions, a worker that never sends named in a typed error while the
others go on, forged and malformed connections refused with their reason, the trainer API finding the
TCP gateway by itself, and ``edge_mode=auto``'s calibration picking by the rule it states."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import numpy as np
import pytest

from netstorm.lan.errors import EdgeTimeout, WireError
from netstorm.lan.header import Precision
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.precision import worker_values

pytestmark = [pytest.mark.root, pytest.mark.slow]
T = TypeVar("T")

SIZES = [150_000, 1234, 7]
SCALE = 16
LANES = 357
JOB = 5
PORT = 9450
SECRET = b"t" * 32
CYCLE = [Precision.FIXED32, Precision.FP16, Precision.BF16, Precision.INT8]


def reference(parts: list[list[np.ndarray]], precisions: list[Precision]) -> list[np.ndarray]:
    out = []
    for t in range(len(SIZES)):
        total = np.zeros(SIZES[t], np.int64)
        for p, prec in zip(parts, precisions, strict=True):
            total += np.rint(worker_values(p[t], prec, LANES) * 2.0**SCALE).astype(np.int64)
        out.append((total.astype(np.float64) * 2.0**-SCALE).astype(np.float32))
    return out


async def settled(call: Coroutine[Any, Any, T]) -> T | EdgeTimeout:
    """``call``'s result, or the EdgeTimeout it raised (kept as a value: a TaskGroup would cancel on it)."""
    try:
        return await call
    except EdgeTimeout as exc:
        return exc


def factory(ns: str, address: str) -> Callable[[], socket.socket]:
    from netstorm.emulation.netns import run_in

    def make() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((address, 0))
        return sock

    return lambda: run_in(ns, make)


def listener(lan: Any) -> socket.socket:
    from netstorm.emulation.bridge_lan import GATEWAY_IP
    from netstorm.emulation.netns import run_in

    def make() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((GATEWAY_IP, PORT))
        return sock

    return run_in(lan.gateway, make)


async def run_tcp_lan(workers: int, iterations: int, *, silent: int | None = None, timeout: float = 20.0,  # noqa: ASYNC109
                      intruders: bool = False) -> dict[str, Any]:
    from bpf.tcpagent import TcpEdgeAgent
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.lan import tcpwire
    from netstorm.lan.tcpclient import TcpEdgeWorker

    rng = np.random.default_rng(workers * 11 + iterations)
    layout = EdgeLayout.uniform(SIZES, scale=SCALE, lanes=LANES)
    out: dict[str, Any] = {"checked": 0, "errors": [], "refusals": []}
    with Lan(workers) as lan:
        agent = TcpEdgeAgent(listener(lan), layout, workers=workers, job=JOB, secret=SECRET)
        nodes = [TcpEdgeWorker((GATEWAY_IP, PORT), worker=i, sizes=SIZES, job=JOB, secret=SECRET,
                               precision=CYCLE[i % 4], socket_factory=factory(ns, lan.worker_ip(i)))
                 for i, ns in enumerate(lan.workers)]
        async with asyncio.TaskGroup() as tg:
            serving = tg.create_task(agent.run())
            try:
                await asyncio.sleep(0)   # the listener is up before the workers connect
                await asyncio.gather(*(n.hello(timeout=10) for n in nodes))
                await agent.wait_workers(timeout=10)
                if intruders:
                    out["refusals"] = await intrude(lan, tcpwire)
                for k in range(iterations):
                    parts = [[rng.standard_normal(s).astype(np.float32) for s in SIZES] for _ in range(workers)]
                    active = [n for n in nodes if n.worker != silent]
                    limit = timeout if silent is not None else 30.0   # short only where the silence is
                    pushes = [tg.create_task(settled(n.push_pull(k, parts[n.worker], timeout=limit + 2)))
                              for n in active]
                    try:
                        sums = await agent.collect(k, timeout=limit)
                    except EdgeTimeout as exc:
                        out["errors"].append(exc)
                        out["errors"] += [await task for task in pushes]
                        silent = None   # it speaks from the next iteration on
                        continue
                    expected = reference(parts, [n.precision for n in nodes])
                    for got, want in zip(sums, expected, strict=True):
                        assert np.array_equal(got, want)
                    await agent.send_results(k, sums, total=workers + 1)
                    for task in pushes:
                        done = await task
                        assert not isinstance(done, BaseException), done
                        got_sums, total = done
                        assert total == workers + 1
                        for got, want in zip(got_sums, expected, strict=True):
                            assert np.array_equal(got, want)
                    out["checked"] += 1
            finally:
                for n in nodes:
                    n.close()
                agent.close()
                await serving
        out["refused"] = agent.core.refused
    return out


async def intrude(lan: Any, tcpwire: Any) -> list[str]:
    """A forged HELLO (no secret) and garbage, each on its own connection from worker 0's host: what each
    is told before the gateway closes it."""
    from netstorm.emulation.bridge_lan import GATEWAY_IP
    from netstorm.lan.tcpwire import Hello

    told = []
    for data in (tcpwire.encode(Hello(JOB, 0, 1, 42, tuple(SIZES), 0)), b"\x00" * 64):
        sock = factory(lan.workers[0], lan.worker_ip(0))()
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (GATEWAY_IP, PORT))
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(data)
        async with asyncio.timeout(10):
            reply = await reader.read()   # to EOF: the gateway closes after the refusal
        writer.close()
        prefix = tcpwire.PREFIX.unpack_from(reply)
        told.append(repr(tcpwire.decode_header(reply[tcpwire.PREFIX.size: tcpwire.PREFIX.size + prefix[2]])))
    return told


@pytest.mark.parametrize("workers", [2, 8])
def test_exact_sums_over_many_iterations_at_mixed_precisions(workers: int) -> None:
    out = asyncio.run(run_tcp_lan(workers, iterations=6))
    assert out["checked"] == 6 and out["refused"] == 0


def test_a_worker_that_never_sends_is_named_and_the_others_go_on() -> None:
    out = asyncio.run(run_tcp_lan(3, iterations=2, silent=1, timeout=1.5))
    assert out["checked"] == 1   # the iteration after the silent one completes, exactly
    gateway = [e for e in out["errors"] if "missing workers [1]" in str(e)]
    workers = [e for e in out["errors"] if "no result of iteration 0" in str(e)]
    assert len(gateway) == 1 and len(workers) == 2, [str(e) for e in out["errors"]]


def test_forged_and_malformed_connections_are_refused_and_the_workers_go_on() -> None:
    out = asyncio.run(run_tcp_lan(2, iterations=2, intruders=True))
    assert out["checked"] == 2 and out["refused"] == 2
    forged, garbage = out["refusals"]
    assert "FORGED" in forged and "without its token" in forged
    assert "MALFORMED" in garbage and "magic" in garbage


def test_the_trainer_api_finds_the_tcp_gateway_by_itself() -> None:
    """``edge://...`` without ``transport=``: the worker tries TCP and UDP in turn and takes TCP here."""
    from bpf.tcpagent import TcpEdgeAgent
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.lan.client import AsyncEdgeClient

    async def main() -> None:
        with Lan(2) as lan:
            layout = EdgeLayout.uniform([1000, 4], scale=SCALE, lanes=LANES)   # by name: a, b
            agent = TcpEdgeAgent(listener(lan), layout, workers=2, job=JOB, secret=SECRET)
            clients = [AsyncEdgeClient((GATEWAY_IP, PORT), i, job=JOB, timeout=10, secret=SECRET,
                                       sock=lan.udp_socket(ns, lan.worker_ip(i)),
                                       socket_factory=factory(ns, lan.worker_ip(i)), precision=CYCLE[i])
                       for i, ns in enumerate(lan.workers)]
            tensors = {"a": np.zeros(1000, np.float32), "b": np.zeros((2, 2), np.float32)}
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(agent.run())
                try:
                    inits = [tg.create_task(c.init(tensors)) for c in clients]
                    await agent.wait_workers(timeout=10)
                    start = [np.full(1000, 0.5, np.float32), np.arange(4, dtype=np.float32)]
                    await agent.send_results(7, start, total=3)
                    for task in inits:
                        got = await task
                        assert np.array_equal(got["a"], start[0]) and got["b"].shape == (2, 2)
                    assert [c.transport for c in clients] == ["tcp", "tcp"]
                    grads = [{"a": np.full(1000, 0.25 * (i + 1), np.float32), "b": np.ones((2, 2), np.float32)}
                             for i in range(2)]
                    pushes = [tg.create_task(c.push_pull(g, average=True)) for c, g in zip(clients, grads, strict=True)]
                    sums = await agent.collect(8, timeout=10)
                    assert np.array_equal(sums[0], np.full(1000, 0.75, np.float32))
                    await agent.send_results(8, sums, total=3)
                    for task in pushes:
                        got = await task
                        assert np.array_equal(got["a"], np.full(1000, np.float32(0.75) / np.float32(3)))
                finally:
                    for c in clients:
                        await c.close()
                    agent.close()
                    await serving

    asyncio.run(main())


@pytest.mark.bcc
def test_auto_calibration_measures_the_paths_and_takes_the_rules_pick() -> None:
    """``edge_mode=auto`` measured: every path the calibration ran returned exact sums, and its pick is the
    pure rule applied to what it measured."""
    from netstorm.bench.edge import calibrate
    from netstorm.lan.pathpick import Measured, pick

    out = calibrate(2, elements=50_000, iterations=2, paths=("xdp", "tcp"))
    measured = {p: Measured(out[p], out[p] is not None, out.get(f"{p}_host_cpu_seconds_per_gb"),
                            out.get(f"{p}_error")) for p in ("xdp", "tcp")}
    assert out["tcp"] is not None, out
    assert out["pick"] == pick(measured, ("xdp", "tcp")).path and out["reason"]


def test_refusal_reaches_a_worker_as_a_typed_error() -> None:
    """A worker whose token is wrong (another secret) gets the gateway's REFUSAL as a WireError at HELLO."""
    from bpf.tcpagent import TcpEdgeAgent
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.lan.tcpclient import TcpEdgeWorker

    async def main() -> None:
        with Lan(1) as lan:
            agent = TcpEdgeAgent(listener(lan), EdgeLayout.uniform(SIZES, scale=SCALE, lanes=LANES), workers=1,
                                 job=JOB, secret=SECRET)
            worker = TcpEdgeWorker((GATEWAY_IP, PORT), worker=0, sizes=SIZES, job=JOB, secret=b"other" * 8,
                                   socket_factory=factory(lan.workers[0], lan.worker_ip(0)))
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(agent.run())
                try:
                    await asyncio.sleep(0)
                    with pytest.raises(WireError, match=r"refused \(forged\).*without its token"):
                        await worker.hello(timeout=10)
                finally:
                    worker.close()
                    agent.close()
                    await serving

    asyncio.run(main())
