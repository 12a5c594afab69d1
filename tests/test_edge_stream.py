"""Results streamed chunk by chunk (``EdgeAgent.stream_results``): when the LAN's own sum is the result, each
chunk's result leaves as the chunk completes. Proved by event order on loopback: the workers hold back one
datagram of the iteration, so it cannot complete, and the results of every other chunk must reach them
first, exact; then the last datagram completes it. In namespaces, streamed results keep the sums exact on
one and two levels with a pool much smaller than the model (``test_edge_levels.run_lan``)."""

from __future__ import annotations

import asyncio
import socket
import time

import numpy as np

from netstorm.lan.header import HEADER_BYTES, HEADER_DTYPE, Kind
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import data_packets

LANES = 357
LAYOUT = EdgeLayout.uniform([LANES * 6 + 11, 40], scale=16, lanes=LANES)
"""9 chunks over two tensors."""
JOB = 21
WORKERS = 2


def _socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


async def _results(sock: socket.socket, want: set[int], iteration: int, *, timeout: float) -> dict[int, np.ndarray]:  # noqa: ASYNC109
    """RESULT lanes by sequence number, received on ``sock`` until every chunk of ``want`` came (or the
    deadline: the caller's assertion names what is missing)."""
    loop = asyncio.get_running_loop()
    got: dict[int, np.ndarray] = {}
    deadline = time.monotonic() + timeout
    while not want <= set(got) and time.monotonic() < deadline:
        try:
            data = await asyncio.wait_for(loop.sock_recv(sock, 65536), deadline - time.monotonic())
        except TimeoutError:
            break
        head = np.frombuffer(data[:HEADER_BYTES], HEADER_DTYPE)[0]
        if head["kind"] != Kind.RESULT or head["iteration"] != iteration:
            continue
        seq = LAYOUT.seq(int(head["tensor"]), int(head["chunk"]))
        got[seq] = np.frombuffer(data, "<f4", count=int(head["count"]), offset=HEADER_BYTES).copy()
    return got


def _exact(contribs: list[list[np.ndarray]]) -> list[np.ndarray]:
    """The sum both workers' fixed-point lanes make, as float32 (what every result must carry)."""
    out = []
    for t in range(len(LAYOUT.sizes)):
        total = np.sum([np.rint(c[t].astype(np.float64) * 2.0**16).astype(np.int64) for c in contribs], axis=0)
        out.append((total.astype(np.float64) * 2.0**-16).astype(np.float32))
    return out


async def _stream_scene() -> dict[str, object]:
    from bpf.agent import EdgeAgent
    from netstorm.lan.sender import EdgeSender

    gateway = _socket()
    agent = EdgeAgent(gateway, LAYOUT, workers=WORKERS, job=JOB, mode="userspace", slot_timeout=5.0)
    address = gateway.getsockname()
    socks = [_socket() for _ in range(WORKERS)]
    senders = [EdgeSender(s, address, worker=w, layout=LAYOUT, job=JOB) for w, s in enumerate(socks)]
    rng = np.random.default_rng(3)
    contribs = [[rng.standard_normal(n).astype(np.float32) for n in LAYOUT.sizes] for _ in range(WORKERS)]
    want = _exact(contribs)
    iteration = 7
    out: dict[str, object] = {}
    async with asyncio.TaskGroup() as tg:
        serving = tg.create_task(agent.run())
        try:
            await asyncio.gather(*(s.hello(timeout=10) for s in senders))
            await agent.wait_workers(timeout=10)
            agent.expect(iteration)
            agent.stream_results(iteration, total=WORKERS)
            collect = tg.create_task(agent.collect(iteration, timeout=30))
            rows = [np.concatenate([data_packets(LAYOUT, job=JOB, worker=w, iteration=iteration, tensor=t, values=v)
                                    for t, v in enumerate(contribs[w])]) for w in range(WORKERS)]
            last = LAYOUT.num_chunks - 1
            for w, sock in enumerate(socks):   # every datagram but worker 1's last chunk
                for seq, row in enumerate(rows[w]):
                    if not (w == 1 and seq == last):
                        sock.sendto(row.tobytes(), address)
            early = await _results(socks[0], set(range(last)), iteration, timeout=20)
            out["early"] = early
            out["done_before_last"] = collect.done()
            socks[1].sendto(rows[1][last].tobytes(), address)
            sums = await collect
            out["late"] = await _results(socks[0], {last}, iteration, timeout=20)
            out["sums"] = sums
            out["want"] = want
            out["streamed"] = agent.streamed_chunks
        finally:
            agent.close()
            await serving
    for s in senders:
        s.close()
    for sock in (gateway, *socks):
        sock.close()
    return out


def _chunk(values: list[np.ndarray], seq: int) -> np.ndarray:
    tensor, chunk = LAYOUT.locate(seq)
    a, b = LAYOUT.bounds(tensor, chunk)
    return values[tensor][a:b]


def test_results_leave_chunk_by_chunk_before_the_iteration_completes() -> None:
    out = asyncio.run(_stream_scene())
    early = out["early"]
    want = out["want"]
    assert isinstance(early, dict) and isinstance(want, list)
    last = LAYOUT.num_chunks - 1
    # every chunk but the held-back one came back while the iteration could not be complete
    assert set(early) == set(range(last)), sorted(early)
    assert out["done_before_last"] is False
    for seq, lanes in early.items():
        np.testing.assert_array_equal(lanes, _chunk(want, seq))
    late = out["late"]
    assert isinstance(late, dict) and set(late) == {last}
    np.testing.assert_array_equal(late[last], _chunk(want, last))
    sums = out["sums"]
    assert isinstance(sums, list)
    for got, expected in zip(sums, want, strict=True):
        np.testing.assert_array_equal(got, expected)
    assert out["streamed"] == last
