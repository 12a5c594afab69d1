"""A gateway hands the node each part of a tensor as soon as the LAN summed it: the readiness core (LAN
chunks against the node's parts, which they straddle), the node's part-by-part contribution (a chunk goes
up before the rest of its tensor is in, with the sums of a whole push), and the gateway role with a real
userspace agent: a part is handed before the iteration's last LAN chunk completes (by event order), every
handed part is exactly the numpy sum, and a LAN sum that never completes fails the parts not handed with
its typed error."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from bpf.lanparts import PartReadiness
from netstorm.errors import ChunkError
from netstorm.lan.header import Precision
from netstorm.lan.layout import EdgeLayout
from netstorm.layout import Layout, TensorSpec
from node.chunks import ChunkCore, Send

LANES = 100
SCALE = 16
JOB = 3


def test_key_parts_split_only_a_tensor_that_fills_its_chunks_alone() -> None:
    layout = Layout.build([TensorSpec("a", (2500,), "float32"), TensorSpec("b", (30,), "float32"),
                           TensorSpec("c", (40,), "float32")], chunk_size=1000)
    assert layout.key_parts(0) == [(0, 834), (834, 1667), (1667, 2500)]
    assert layout.key_parts(1) == [(0, 30)] and layout.key_parts(2) == [(0, 40)]   # they share a chunk


def test_a_part_is_ready_once_every_lan_chunk_overlapping_it_completed() -> None:
    lan = EdgeLayout.uniform([250, 450], scale=SCALE, lanes=LANES, pool=64)   # tensor 1: LAN chunks 3..7
    ready = PartReadiness(lan)
    assert ready.watch(1, [(0, 150), (150, 300), (300, 450)]) == []
    # LAN chunk 4 ([100, 200)) straddles parts 0 and 1; chunk 3 is part 0's alone
    assert ready.completed(np.array([3])) == []
    assert ready.completed(np.array([4, 4])) == [(1, 0)]
    assert ready.completed(np.array([7, 6])) == [(1, 2)]
    assert ready.completed(np.array([0, 1, 2])) == []          # the other tensor's chunks
    assert ready.completed(np.array([5, 5, 3])) == [(1, 1)]   # duplicates and repeats count once
    assert ready.ready(1).tolist() == [True, True, True]


def test_parts_already_complete_are_ready_at_once_and_bad_parts_are_refused() -> None:
    lan = EdgeLayout.uniform([300], scale=SCALE, lanes=LANES, pool=64)
    done = np.array([True, False, True])
    ready = PartReadiness(lan, done)
    assert ready.watch(0, [(0, 100), (100, 200), (200, 300)]) == [0, 2]
    assert ready.completed(np.array([1])) == [(0, 1)]
    with pytest.raises(ValueError, match="do not cover"):
        PartReadiness(lan).watch(0, [(0, 100), (150, 300)])


def test_a_part_goes_up_before_the_rest_of_its_tensor_with_the_sums_of_a_whole_push() -> None:
    from tests.test_node_core import STAR  # node 2 is a leaf of the star rooted at node 4

    layout = Layout.build([TensorSpec("w", (3000,), "float32")], chunk_size=1000)
    rng = np.random.default_rng(5)
    values = rng.standard_normal(3000).astype(np.float32)
    whole = ChunkCore(2, layout)
    whole.bind_policy(5, STAR)
    sent_whole = {a.header.chunk: a.payload for a in whole.push_local(5, 0, values) if isinstance(a, Send)}
    parted = ChunkCore(2, layout)
    parted.bind_policy(5, STAR)
    parts = layout.key_parts(0)
    sent: dict[int, np.ndarray] = {}
    for part in (1, 0, 2):
        start, stop = parts[part]
        actions = parted.push_part(5, 0, part, values[start:stop])
        assert [a.header.chunk for a in actions if isinstance(a, Send)] == [part]   # that chunk, at once
        assert parted.key_pushed(5, 0) == (part == 2)
        sent.update({a.header.chunk: a.payload for a in actions if isinstance(a, Send)})
    assert sent.keys() == sent_whole.keys()
    for chunk, payload in sent.items():
        np.testing.assert_array_equal(payload, sent_whole[chunk])
    with pytest.raises(ChunkError, match="pushed twice"):
        parted.push_part(5, 0, 1, values[parts[1][0]:parts[1][1]])
    with pytest.raises(ChunkError, match="pushed twice"):
        parted.push_local(5, 0, values)


def _socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


async def _gateway_scene(*, hold_last: bool, iteration_timeout: float) -> dict[str, object]:
    """A gateway role over a real userspace agent and two workers' DATA on loopback; worker 1 holds its
    last LAN chunk back until the node was handed every part it can be (or, ``hold_last``, for good)."""
    from bpf.agent import EdgeAgent
    from bpf.gateway import EdgeOptions, GatewayRole
    from netstorm.lan.packets import data_packets
    from netstorm.lan.sender import EdgeSender

    sizes = [2500]
    lan = EdgeLayout.uniform(sizes, scale=SCALE, lanes=LANES, pool=64)
    parts = [(0, 834), (834, 1667), (1667, 2500)]
    gateway = _socket()
    agent = EdgeAgent(gateway, lan, workers=2, job=JOB, mode="userspace", slot_timeout=5.0)
    role = GatewayRole(EdgeOptions(workers=2, listen=("127.0.0.1", 0), mode="userspace", job=JOB),
                       iteration_timeout=iteration_timeout)
    role.agent = agent
    role.init_iteration = 1
    role._started.set()
    address = gateway.getsockname()
    socks = [_socket() for _ in range(2)]
    senders = [EdgeSender(s, address, worker=w, layout=lan, job=JOB) for w, s in enumerate(socks)]
    rng = np.random.default_rng(11)
    lan_values = [rng.standard_normal(2500).astype(np.float32) for _ in range(2)]
    own = rng.standard_normal(2500).astype(np.float32)
    exact = np.sum([np.rint(v.astype(np.float64) * 2.0**SCALE) for v in lan_values], axis=0) * 2.0**-SCALE
    iteration = 2
    events: list[tuple[str, int]] = []
    handed: dict[int, np.ndarray] = {}
    last = lan.num_chunks - 1
    some_handed = asyncio.Event()

    def hand(part: int, summed: np.ndarray) -> None:
        events.append(("handed", part))
        handed[part] = summed
        some_handed.set()

    out: dict[str, object] = {"events": events, "handed": handed, "parts": parts, "own": own, "exact": exact,
                              "last": last}
    async with asyncio.TaskGroup() as tg:
        serving = tg.create_task(role.run())
        try:
            await asyncio.gather(*(s.hello(timeout=10) for s in senders))
            await agent.wait_workers(timeout=10)
            combining = asyncio.create_task(role.combine_parts(iteration, 0, own, sizes, parts, hand))
            rows = [data_packets(lan, job=JOB, worker=w, iteration=iteration, tensor=0, values=lan_values[w])
                    for w in range(2)]
            for w, sock in enumerate(socks):
                for seq, row in enumerate(rows[w]):
                    if not (w == 1 and seq == last):
                        sock.sendto(row.tobytes(), address)
            async with asyncio.timeout(20):
                while len(handed) < len(parts) - 1:   # every part but the one under the held-back chunk
                    some_handed.clear()
                    await some_handed.wait()
            events.append(("last LAN chunk sent", last))
            if not hold_last:
                socks[1].sendto(rows[1][last].tobytes(), address)
            try:
                await combining
            except Exception as exc:
                out["error"] = exc
        finally:
            agent.close()
            serving.cancel()
    for s in senders:
        s.close()
    for sock in (gateway, *socks):
        sock.close()
    return out


def test_the_gateway_hands_a_part_before_the_iterations_last_lan_chunk_completes() -> None:
    out = asyncio.run(_gateway_scene(hold_last=False, iteration_timeout=30))
    events = out["events"]
    assert isinstance(events, list)
    cut = events.index(("last LAN chunk sent", out["last"]))
    # parts 0 and 1 were handed while the iteration's last LAN chunk had not even been sent
    assert sorted(p for kind, p in events[:cut] if kind == "handed") == [0, 1]
    assert events[cut + 1:] == [("handed", 2)]
    handed, parts, own, exact = out["handed"], out["parts"], out["own"], out["exact"]
    assert isinstance(handed, dict) and isinstance(parts, list)
    assert isinstance(own, np.ndarray) and isinstance(exact, np.ndarray)
    for part, (start, stop) in enumerate(parts):
        want = own[start:stop] + exact[start:stop].astype(np.float32)
        np.testing.assert_array_equal(handed[part], want)
    assert "error" not in out


def test_a_lan_sum_that_never_completes_fails_only_the_parts_not_handed_with_a_typed_error() -> None:
    from netstorm.lan.errors import EdgeTimeout

    out = asyncio.run(_gateway_scene(hold_last=True, iteration_timeout=1.5))
    handed = out["handed"]
    assert isinstance(handed, dict) and sorted(handed) == [0, 1]
    error = out.get("error")
    assert isinstance(error, EdgeTimeout), error
    assert "2 of tensor 0's 3 parts were handed" in str(error) and "chunk 24" in str(error)


async def _tcp_gateway_scene() -> dict[str, object]:
    """The gateway role over a TCP agent whose frames are fed by plain calls (conn i is worker i): worker 1
    holds its frames after the first back until the node was handed every part below it."""
    from bpf.gateway import EdgeOptions, GatewayRole
    from bpf.tcpagent import TcpEdgeAgent
    from tests.test_edge_tcp import SECRET, Lan

    lan = Lan(2)   # tensors of 200,000, 1,234 and 7 elements; 512 LAN chunks of 357 lanes a frame
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    agent = TcpEdgeAgent(listener, lan.layout, workers=2, job=lan.core.job, secret=SECRET)
    agent.core = lan.core
    role = GatewayRole(EdgeOptions(workers=2, listen=("127.0.0.1", 0), mode="tcp", job=lan.core.job),
                       iteration_timeout=30)
    role.agent = agent
    role.init_iteration = 1
    role._started.set()
    rng = np.random.default_rng(7)
    size = lan.layout.sizes[0]
    values = [[rng.standard_normal(s).astype(np.float32) for s in lan.layout.sizes] for _ in range(2)]
    exact = np.sum([np.rint(v[0].astype(np.float64) * 2.0**16) for v in values], axis=0) * 2.0**-16
    parts = [(a, min(a + 20_000, size)) for a in range(0, size, 20_000)]
    handed: dict[int, np.ndarray] = {}
    events: list[tuple[str, int]] = []

    def hand(part: int, summed: np.ndarray) -> None:
        events.append(("handed", part))
        handed[part] = summed

    iteration = 2
    streams = [lan.frames(w, iteration, values[w], Precision.FIXED32) for w in range(2)]
    async with asyncio.TaskGroup() as tg:
        serving = tg.create_task(role.run())
        try:
            combining = asyncio.create_task(role.combine_parts(iteration, 0, None, list(lan.layout.sizes), parts,
                                                               hand))
            await asyncio.sleep(0)
            for w in range(2):   # worker 1 sends only its first frame (workers send in layout order)
                for frame in streams[w][: None if w == 0 else 1]:
                    agent._act(lan.send(w, frame))
            for _ in range(3):
                await asyncio.sleep(0)
            events.append(("last frame of tensor 0 sent", 1))
            for frame in streams[1][1:]:
                agent._act(lan.send(1, frame))
            await asyncio.wait_for(combining, 10)
        finally:
            agent.close()
            serving.cancel()
    listener.close()
    return {"events": events, "handed": handed, "parts": parts, "exact": exact, "frame": lan.core.segment}


def test_on_the_tcp_path_parts_under_every_workers_first_frame_are_handed_before_the_rest_arrives() -> None:
    out = asyncio.run(_tcp_gateway_scene())
    events, parts, frame = out["events"], out["parts"], out["frame"]
    assert isinstance(events, list) and isinstance(parts, list) and isinstance(frame, int)
    cut = events.index(("last frame of tensor 0 sent", 1))
    below = [p for p, (_, stop) in enumerate(parts) if stop <= frame]
    assert below and sorted(p for kind, p in events[:cut] if kind == "handed") == below
    assert sorted(p for _, p in events[cut + 1:]) == [p for p in range(len(parts)) if p not in below]
    handed, exact = out["handed"], out["exact"]
    assert isinstance(handed, dict) and isinstance(exact, np.ndarray)
    for part, (start, stop) in enumerate(parts):
        np.testing.assert_array_equal(handed[part], exact[start:stop].astype(np.float32))
