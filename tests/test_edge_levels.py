"""The LAN tier in namespaces with a pool much smaller than the model, one and two levels (ALEPH), mixed
precisions (PAHInA), loss on both levels and on the result path, duplicates, overflow across levels, a
silent worker, and results multicast by the LAN (checked through the kernel: group memberships, the
bridge's multicast database, and one transmission per result datagram at the gateway)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from netstorm.lan.deploy import LanTopology
from netstorm.lan.errors import EdgeTimeout
from netstorm.lan.fixedpoint import rescale_for
from netstorm.lan.header import Precision
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import fit_scales
from netstorm.lan.precision import worker_values
from tests.edge_programs import LentPrograms

pytestmark = [pytest.mark.root]

SCALE = 16
LANES = 357
POOL = 4
SIZES = (LANES * 9 + 5, 7)
"""11 chunks per worker through 4 slots: every slot is reused within an iteration and across them."""
LONG = (LANES * 43 + 5, 7)
"""45 chunks per worker through the same 4 slots: each slot carries 11 or 12 chunks per iteration."""
JOB = 12
PORT = 9460
GROUP = ("239.77.0.12", 9461)
_iterations = itertools.count(200, 20)
ITERATIONS = 4
"""Iterations of the two-level sums test."""


def layout(sizes: tuple[int, ...] = SIZES) -> EdgeLayout:
    return EdgeLayout.uniform(sizes, scale=SCALE, lanes=LANES, pool=POOL)


@pytest.fixture(scope="module", autouse=True)
def cluster_programs() -> Iterator[LentPrograms]:
    """The cluster aggregators of this module's XDP runs borrow their programs from one pool (two for the
    runs with two clusters) instead of compiling one each; the rising ``_iterations`` keep runs apart."""
    import bpf.cluster

    lent = LentPrograms()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bpf.cluster, "XdpAggregator", lent)
        yield lent
    lent.release()


@pytest.fixture(scope="module")
def gateway_program() -> Iterator[Any]:
    from bpf.xdp import XdpAggregator

    agg = XdpAggregator(layout(), job=JOB, port=PORT, expected=1, timeout=0.05)
    yield agg
    agg.close()



def reference(contribs: list[list[np.ndarray]], precisions: list[Precision],
              lay: EdgeLayout | None = None) -> list[np.ndarray]:
    """Exact LAN sums computed as the aggregators do: each worker's values rounded to its precision, as int64
    fixed point at the common scale (or at the rescaled one where a sum or a lane leaves int32)."""
    lay = lay or layout()
    workers = len(contribs)
    out = []
    for t, size in enumerate(lay.sizes):
        result = np.zeros(size, np.float32)
        mine = [worker_values(w[t], p, LANES) for w, p in zip(contribs, precisions, strict=True)]
        for c in range(lay.chunks[t]):
            a, b = lay.bounds(t, c)
            parts = [m[a:b] for m in mine]
            scale = SCALE
            fixed = [np.rint(p * 2.0**scale).astype(np.int64) for p in parts]
            total = np.sum(fixed, axis=0)
            if np.any(np.abs(total) > 2**31 - 1) or any(np.any(np.abs(f) > 2**31 - 1) for f in fixed):
                need = min(int(fit_scales(p.reshape(1, -1))[0]) for p in parts)
                scale = rescale_for(need, workers)
                total = np.sum([np.rint(p * 2.0**scale).astype(np.int64) for p in parts], axis=0)
            result[a:b] = (total.astype(np.float64) * 2.0**-scale).astype(np.float32)
        out.append(result)
    return out


def _tx_packets(device: str = "eth0") -> int:
    for line in Path("/proc/thread-self/net/dev").read_text().splitlines()[2:]:
        name, _, rest = line.partition(":")
        if name.strip() == device:
            return int(rest.split()[9])
    raise AssertionError(f"no {device} in /proc/net/dev")


async def run_lan(mode: str, program: Any, *, workers: int, iterations: int, topology: LanTopology | None = None,
                  precisions: list[Precision] | None = None, loss: float = 0.0, wire_loss: float = 0.0,
                  duplicate: float = 0.0, silent: int | None = None, big: bool = False,
                  timeout: float = 20.0, secret: bytes | None = None,  # noqa: ASYNC109
                  tmp: Path | None = None, stream: bool = False, kernel: bool = False,
                  integers: tuple[int, ...] | None = None, sizes: tuple[int, ...] = SIZES,
                  far: dict[int, int] | None = None) -> dict[str, Any]:
    """``integers``: each worker's peak; the workers then push exact integers at scale 0 on int8 lanes as a
    compressed job's round does, each widening its push where its integers outgrow them. ``sizes``: the
    model's tensors (through the same POOL slots). ``kernel``: the gateway's XDP program returns every
    result itself (``EdgeAgent.return_results_from_kernel``, shadow slots); the agent only waits for the
    program's report that an iteration's results all left, and the workers' results are checked. ``far``:
    iteration (counted from the first) -> a member that, as it begins, also sends its aggregator DATA of an
    iteration FAR beyond it (``_far_future``)."""
    from bpf.agent import EdgeAgent
    from bpf.cluster import ClusterAggregator
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.emulation.netns import run_in
    from netstorm.lan.sender import EdgeSender

    topology = topology or LanTopology(workers)
    precisions = precisions or [Precision.FIXED32 if integers is None else Precision.INT8] * workers
    rng = np.random.default_rng(workers * 31 + iterations)
    lay = layout(sizes) if integers is None else EdgeLayout.uniform(sizes, scale=0, lanes=LANES, pool=POOL)
    if kernel:
        lay = dataclasses.replace(lay, shadow=True)
    out: dict[str, Any] = {"checked": 0}
    with Lan(workers) as lan:
        if wire_loss:
            from netstorm.emulation import lossfilter

            assert tmp is not None
            ports = {(lan.bridge, port): wire_loss for port in ("g", *(f"w{i}" for i in range(workers)))}
            lossfilter.attach(ports, tmp / "bpf")
        xdp = None
        before_stats: dict[str, int] = {}
        if mode == "xdp":
            xdp = program
            before_stats = xdp.stats()
            xdp.configure(job=JOB, port=PORT, expected=topology.gateway_mask(), timeout=0.05, max_nacks=50)
            ifindex = lan.gateway_ifindex()
            run_in(lan.gateway, lambda: xdp.attach(ifindex))
        clusters: list[ClusterAggregator] = []
        try:
            agent = EdgeAgent(lan.udp_socket(lan.gateway, GATEWAY_IP, PORT), lay, workers=workers, job=JOB, mode=mode,
                              xdp=xdp, slot_timeout=0.05, max_nacks=50, secret=secret, group=GROUP,
                              topology=topology, retransmit=0.01)
            if kernel:
                from netstorm.emulation.bridge_lan import GATEWAY_PORT

                run_in(lan.bridge, lambda: _pass_program().attach(GATEWAY_PORT))
                agent.return_results_from_kernel(lan.gateway_mac())
                out["udp_out"] = run_in(lan.gateway, _udp_out_datagrams)
            nodes = [EdgeSender(lan.udp_socket(ns, lan.worker_ip(i)), (GATEWAY_IP, PORT), worker=i, layout=lay,
                                job=JOB, loss=loss, seed=5, secret=secret, precision=precisions[i],
                                group_opener=lan.group_opener(ns)) for i, ns in enumerate(lan.workers)]
            for node in nodes:
                node.duplicate = duplicate
                node.integers = integers is not None
            first = next(_iterations)
            agent.expect(first)
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(agent.run())
                try:
                    for head in topology.clusters:
                        ns = lan.workers[head]
                        cluster = ClusterAggregator(lan.udp_socket(ns, lan.worker_ip(head), PORT), (GATEWAY_IP, PORT),
                                                    worker=head, job=JOB, interface="eth0", mode=mode, secret=secret,
                                                    group_opener=lan.group_opener(ns), attach="generic")
                        clusters.append(cluster)
                        await cluster.start(timeout=10, load_in=functools.partial(run_in, ns))
                        tg.create_task(cluster.run())
                    await asyncio.gather(*(n.hello(timeout=10) for n in nodes))
                    await agent.wait_workers(timeout=10)
                    out["igmp"] = [run_in(ns, lambda: Path("/proc/thread-self/net/igmp").read_text())
                                   for ns in lan.workers]
                    out["tx_per_result"] = []
                    driver = None
                    if kernel:   # as the benchmark does: waits for each iteration while workers go on to the next
                        driver = tg.create_task(_await_completions(agent, first, iterations, timeout))
                    for k in range(iterations):
                        iteration = first + k
                        for cluster in clusters:
                            cluster.follow(iteration)
                        contribs = [[rng.standard_normal(s).astype(np.float32) for s in lay.sizes]
                                    for _ in range(workers)]
                        if big:
                            for w in contribs:
                                w[1][:] = 2.0**14 * 0.75   # fits at scale 16, a sum of several workers does not
                        if integers is not None:
                            contribs = [[rng.integers(-p, p + 1, s).astype(np.float32) for s in lay.sizes]
                                        for p in integers]
                        total = workers if kernel else workers + k
                        if stream:   # each chunk's result leaves as the chunk completes
                            agent.stream_results(iteration, total=total)
                        pushes = [tg.create_task(n.push_pull(iteration, contribs[n.worker], timeout=timeout + 5))
                                  for n in nodes if n.worker != silent]
                        if far is not None and k in far:
                            await _far_future(lan, topology, lay, far[k], iteration)
                        expected = (reference(contribs, precisions, lay) if integers is None else
                                    [np.sum([w[t].astype(np.int64) for w in contribs], axis=0).astype(np.float32)
                                     for t in range(len(lay.sizes))])
                        if not kernel:   # (no sum reaches the agent there: the workers' results are checked)
                            sums = await agent.collect(iteration, timeout=timeout)
                            for got, want in zip(sums, expected, strict=True):
                                np.testing.assert_array_equal(got, want)
                        if not stream and not kernel:
                            before = run_in(lan.gateway, _tx_packets)
                            await agent.send_results(iteration, sums, total=total)
                            out["tx_per_result"].append((run_in(lan.gateway, _tx_packets) - before) / lay.num_chunks)
                        for task in pushes:
                            got_sums, got_total = await task
                            assert got_total == total
                            for got, want in zip(got_sums, expected, strict=True):
                                np.testing.assert_array_equal(got, want)
                        out["checked"] += 1
                    if driver is not None:
                        await driver
                finally:
                    agent.close()
                    out["cluster_stats"] = [c.stats() for c in clusters]
                    for cluster in clusters:
                        cluster.close()
                    await serving
            out["mdb"] = _bridge_mdb(lan.bridge)
            out["gateway_link"] = _link(lan.gateway)
            stats = xdp.stats() if xdp is not None else dict(agent.fallback.counters)  # type: ignore[union-attr]
            out["stats"] = {k: v - before_stats.get(k, 0) for k, v in stats.items()}   # this run's alone
            out["kernel_map_bytes"] = xdp.kernel_map_bytes() if xdp is not None else 0
            out["retransmitted"] = sum(n.retransmitted for n in nodes)
            out["dropped"] = sum(n.dropped for n in nodes)
            out["rescaled"] = sum(n.rescaled for n in nodes)
            out["widened"] = [n.widened for n in nodes]
            out["acks"] = agent.acks_sent
            out["streamed"] = agent.streamed_chunks
            if kernel:   # datagrams the gateway's sockets sent meanwhile, as its kernel counts them
                out["udp_out"] = run_in(lan.gateway, _udp_out_datagrams) - out["udp_out"]
            return out
        finally:
            for node in nodes if "nodes" in locals() else []:
                node.close()
            if xdp is not None:
                xdp.detach()
                xdp.require_tokens(0)
                xdp.return_results(None)


FAR = 10**6
"""Iterations ahead of the one being summed that a far-future DATA claims."""


async def _far_future(lan: Any, topology: LanTopology, lay: EdgeLayout, worker: int, iteration: int) -> None:
    """From member ``worker``'s namespace, one DATA of iteration ``iteration + FAR`` for every slot of its
    cluster's aggregator: were one taken, the chunk being summed there would be evicted, and the next to use
    that slot refused as older than the slot's key (nobody could resend it)."""
    from netstorm.lan.packets import data_packets
    from netstorm.lan.udp import sendto

    head = next(h for h, members in topology.clusters.items() if worker in members)
    rows = data_packets(lay, job=JOB, worker=worker, iteration=iteration + FAR, tensor=0,
                        values=np.ones(lay.sizes[0], np.float32))
    sock = lan.udp_socket(lan.workers[worker], lan.worker_ip(worker))
    try:
        for row in rows[:POOL]:
            await sendto(sock, row.tobytes(), (lan.worker_ip(head), PORT))
    finally:
        sock.close()


async def _await_completions(agent: Any, first: int, iterations: int, timeout: float) -> None:  # noqa: ASYNC109
    """Wait for each iteration's report from the program in turn, as ``bench edge --results kernel`` does: by the
    time a worker still recovers a lost result of one iteration, this already waits for the next."""
    for k in range(iterations):
        await agent.completed(first + k, timeout=timeout)


_passer: list[Any] = []


def _pass_program() -> Any:
    """One XDP pass program for every run here: the bridge's end of the gateway's veth runs it, so it takes
    the frames the gateway's program sends back out (XDP_TX)."""
    from bpf.xdp import PassProgram

    if not _passer:
        _passer.append(PassProgram())
    return _passer[0]


def _udp_out_datagrams() -> int:
    """UDP datagrams this namespace's sockets sent (the kernel's count, /proc/net/snmp)."""
    lines = [line.split() for line in Path("/proc/thread-self/net/snmp").read_text().splitlines()
             if line.startswith("Udp:")]
    return int(lines[1][lines[0].index("OutDatagrams")])


def _bridge_mdb(namespace: str) -> str:
    """The bridge's multicast database: the ports it copies each group to."""
    import subprocess

    return subprocess.run(["bridge", "-n", namespace, "mdb", "show"], capture_output=True, text=True).stdout


def _link(namespace: str) -> str:
    import subprocess

    return subprocess.run(["ip", "-n", namespace, "-d", "link", "show", "eth0"], capture_output=True, text=True).stdout


def group_hex() -> str:
    """The group address as /proc/net/igmp prints it (the address's bytes in host order, in hex)."""
    import socket

    return socket.inet_aton(GROUP[0])[::-1].hex().upper()


@pytest.mark.slow
def test_one_level_pool_smaller_than_the_model_exact_over_iterations(mode: str, request: pytest.FixtureRequest) -> None:
    program = request.getfixturevalue("gateway_program") if mode == "xdp" else None
    out = asyncio.run(run_lan(mode, program, workers=4, iterations=4))
    assert out["checked"] == 4
    assert layout().num_chunks > 2 * POOL
    # the results went out once each and the LAN copied them to every worker: every worker's kernel holds
    # the group membership, the bridge's multicast database lists the group on every worker's port, and
    # the gateway's interface sent about one packet per result datagram, not one per worker
    assert all(igmp_has_group(text) for text in out["igmp"])
    assert all(f"port w{i} grp {GROUP[0]}" in out["mdb"] for i in range(4)), out["mdb"]
    assert all(x < 1.5 for x in out["tx_per_result"]), out["tx_per_result"]
    if program is not None:   # the aggregation program is what the kernel runs on the gateway's interface
        assert f"prog/xdp id {program.prog_id()}" in out["gateway_link"], out["gateway_link"]


def igmp_has_group(text: str) -> bool:
    return group_hex() in text


@pytest.mark.slow
@pytest.mark.parametrize("workers,clusters", [(2, "0:1"), (5, "1:0,2;3:4"), (8, "0:1,2,3;4:5,6")])
def test_two_levels_exact_sums(mode: str, workers: int, clusters: str, request: pytest.FixtureRequest) -> None:
    """Many iterations of a model of 45 chunks through 4 slots: every slot, at the gateway and at each
    cluster's aggregator, is reused 11-12 times per iteration and again across iterations, and every sum is
    numpy's."""
    program = request.getfixturevalue("gateway_program") if mode == "xdp" else None
    topology = LanTopology.parse(clusters, workers)
    out = asyncio.run(run_lan(mode, program, workers=workers, iterations=ITERATIONS, topology=topology, sizes=LONG))
    assert out["checked"] == ITERATIONS
    chunks = layout(LONG).num_chunks
    assert chunks > 10 * POOL
    # each aggregator forwarded one datagram per chunk per iteration at least (retransmissions re-forward)
    for stats in out["cluster_stats"]:
        assert stats["forwarded"] >= ITERATIONS * chunks
    # the gateway summed one contribution per cluster and per unclustered worker for every chunk of every
    # iteration, not one per worker: whatever else reached it (retransmissions, many on a loaded host, are
    # duplicates or re-emits; a member's DATA is outside its expected mask) was counted and not added
    # (or was refused before any slot: a DATA that beat its iteration's tokens into the map is dropped as
    # bad_token, and recovered by a resend like a lost one)
    st = out["stats"]
    senders = len(topology.clusters) + len(topology.unclustered)
    assert st["complete"] == ITERATIONS * chunks, st
    refused = sum(st[k] for k in ("dup", "reemit", "stale", "unexpected", "bad", "bad_token", "collision"))
    added = st["rx"] - refused
    if st["busy_evicted"] == 0:
        assert added == ITERATIONS * chunks * senders, st
    else:   # the partial sums of slots a newer key took over were added too, and never completed
        assert ITERATIONS * chunks * senders < added < ITERATIONS * chunks * workers, st


@pytest.mark.slow
def test_a_far_future_datagram_to_a_cluster_aggregator_is_refused_and_counted(mode: str,
                                                                             request: pytest.FixtureRequest) -> None:
    """A member's DATA far beyond the window, to its aggregator for every slot as an iteration begins: the
    cluster's horizon (netstorm/lan/clustercore.py) refuses and counts each before it touches a slot, and
    that iteration and the next are numpy's."""
    program = request.getfixturevalue("gateway_program") if mode == "xdp" else None
    topology = LanTopology.parse("0:1,2", 4)
    out = asyncio.run(run_lan(mode, program, workers=4, iterations=3, topology=topology, far={1: 2}))
    assert out["checked"] == 3
    cluster, = out["cluster_stats"]
    assert cluster["future"] == POOL and cluster["busy_evicted"] == 0, cluster
    assert out["stats"]["future"] == 0


@pytest.mark.slow
def test_one_percent_loss_on_both_levels_and_the_result_path_with_duplicates(mode: str, tmp_path: Path,
                                                                             request: pytest.FixtureRequest) -> None:
    program = request.getfixturevalue("gateway_program") if mode == "xdp" else None
    topology = LanTopology.parse("0:1,2", 5)
    out = asyncio.run(run_lan(mode, program, workers=5, iterations=4, topology=topology, loss=0.01,
                              wire_loss=0.01, duplicate=0.02, tmp=tmp_path, secret=b"k" * 32))
    assert out["checked"] == 4
    assert out["retransmitted"] > 0
    # the injected duplicates reached a bitmap that had the bit (dropped while the slot was open, or the
    # completed aggregate re-emitted: a member's copy of a chunk its aggregator had already completed), or,
    # behind a loaded host's queue, a slot a newer chunk had taken over (stale): counted, never added, as the
    # exact sums show; members are no longer NACKed for datagrams their aggregator holds
    levels = [out["stats"], *out["cluster_stats"]]
    assert sum(s["dup"] + s["reemit"] + s["stale"] for s in levels) > 0


@pytest.mark.slow
def test_mixed_precisions_against_numpy_on_two_levels(mode: str, request: pytest.FixtureRequest) -> None:
    program = request.getfixturevalue("gateway_program") if mode == "xdp" else None
    precisions = [Precision.FIXED32, Precision.FP16, Precision.BF16, Precision.INT8, Precision.FP16]
    topology = LanTopology.parse("1:2,3", 5)
    out = asyncio.run(run_lan(mode, program, workers=5, iterations=2, topology=topology, precisions=precisions))
    assert out["checked"] == 2


@pytest.mark.slow
def test_overflow_and_rescale_across_levels(mode: str, request: pytest.FixtureRequest) -> None:
    program = request.getfixturevalue("gateway_program") if mode == "xdp" else None
    topology = LanTopology.parse("0:1,2", 4)
    out = asyncio.run(run_lan(mode, program, workers=4, iterations=1, topology=topology, big=True))
    assert out["checked"] == 1 and out["rescaled"] >= 4


@pytest.mark.slow
@pytest.mark.slow
def test_integers_past_int8_lanes_go_wider_and_stay_exact_on_two_levels(mode: str,
                                                                       request: pytest.FixtureRequest) -> None:
    """An integer round on int8 lanes through a cluster aggregator: the members and unclustered workers
    whose integers outgrow int8 (peaks 1000, 50000) send their pushes wider, the cluster's slots and the
    gateway's add the mix, and both iterations' sums are numpy's exactly, with no overflow flagged."""
    program = request.getfixturevalue("gateway_program") if mode == "xdp" else None
    topology = LanTopology.parse("1:2,3", 5)   # worker 1 aggregates itself and 2 (int32 lanes), 3 (int8)
    out = asyncio.run(run_lan(mode, program, workers=5, iterations=2, topology=topology,
                              integers=(100, 1000, 50_000, 127, 3000)))
    assert out["checked"] == 2
    assert out["widened"] == [0, 2, 2, 0, 2]   # every push of the workers past 127, each iteration
    assert out["stats"]["overflow"] == 0


def test_a_worker_that_never_sends_is_a_named_timeout(mode: str, request: pytest.FixtureRequest) -> None:
    program = request.getfixturevalue("gateway_program") if mode == "xdp" else None
    with pytest.raises(ExceptionGroup) as info:
        asyncio.run(run_lan(mode, program, workers=3, iterations=1, silent=2, timeout=1.5))
    timeouts = [e for e in info.value.exceptions if isinstance(e, EdgeTimeout)]
    assert any("missing workers [2]" in str(e) or "incomplete" in str(e) for e in timeouts), info.value.exceptions


@pytest.mark.slow
@pytest.mark.parametrize("clusters", [None, "0:1,2;3:4"])
def test_streamed_results_exact_on_one_and_two_levels_with_loss(mode: str, clusters: str | None,
                                                                  request: pytest.FixtureRequest) -> None:
    """Each chunk's result leaves as the chunk completes (``EdgeAgent.stream_results``) while workers still
    send: the sums stay exact with 1 % loss, every slot reused within and across iterations."""
    program = request.getfixturevalue("gateway_program") if mode == "xdp" else None
    workers = 5
    topology = LanTopology.parse(clusters, workers) if clusters else None
    out = asyncio.run(run_lan(mode, program, workers=workers, iterations=3, topology=topology, loss=0.01,
                              stream=True))
    assert out["checked"] == 3
    # most results left before their iteration was complete (the last chunk's cannot)
    assert out["streamed"] >= 3 * (layout().num_chunks - 1) // 2, out["streamed"]


@pytest.mark.bcc
def test_the_program_and_its_maps_are_in_the_kernel_and_bounded_by_the_pool(gateway_program: Any) -> None:
    """kernel_map_bytes comes from the kernel's own accounting of the program's maps, and a model of AlexNet's
    size needs no more than its pool."""
    got = gateway_program.kernel_map_bytes()
    assert got >= layout().map_bytes
    big = EdgeLayout.uniform([61_000_000], scale=SCALE, lanes=LANES, pool=4096)
    assert big.map_bytes <= 64 << 20


@pytest.mark.slow
def test_mixed_precisions_against_numpy_on_one_level(mode: str, request: pytest.FixtureRequest) -> None:
    program = request.getfixturevalue("gateway_program") if mode == "xdp" else None
    precisions = [Precision.FP16, Precision.BF16, Precision.INT8, Precision.FIXED32]
    out = asyncio.run(run_lan(mode, program, workers=4, iterations=2, precisions=precisions))
    assert out["checked"] == 2


def _neighbour(ip: str) -> str | None:
    """The link-layer address this namespace's kernel resolved for ``ip`` (None: no complete entry)."""
    for line in Path("/proc/thread-self/net/arp").read_text().splitlines()[1:]:
        parts = line.split()
        if parts and parts[0] == ip and parts[3] != "00:00:00:00:00:00":
            return parts[3]
    return None


def test_members_resolve_their_aggregator_before_the_first_window() -> None:
    """A member has never sent to its cluster's aggregator when its first window leaves; unresolved, the
    kernel keeps only about 100 datagrams of it (unres_qlen_bytes) and drops the rest. Its HELLO is also
    sent to the aggregator once deployed, so the kernel resolves the address first (read from the
    member's neighbour table; an unclustered worker sends nothing there)."""
    import time

    from bpf.agent import EdgeAgent
    from bpf.cluster import ClusterAggregator
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.emulation.netns import run_in
    from netstorm.lan.sender import EdgeSender

    async def scene(lan: Lan) -> list[EdgeSender]:
        topology = LanTopology.parse("0:1", 3)
        agent = EdgeAgent(lan.udp_socket(lan.gateway, GATEWAY_IP, PORT), layout(), workers=3, job=JOB,
                          mode="userspace", group=GROUP, topology=topology)
        head_ns = lan.workers[0]
        head = ClusterAggregator(lan.udp_socket(head_ns, lan.worker_ip(0), PORT), (GATEWAY_IP, PORT), worker=0, job=JOB,
                                 interface="eth0", mode="userspace", group_opener=lan.group_opener(head_ns))
        nodes = [EdgeSender(lan.udp_socket(ns, lan.worker_ip(i)), (GATEWAY_IP, PORT), worker=i, layout=layout(),
                            job=JOB, group_opener=lan.group_opener(ns)) for i, ns in enumerate(lan.workers)]
        async with asyncio.TaskGroup() as tg:
            serving = tg.create_task(agent.run())
            try:
                await head.hello(timeout=10)
                await asyncio.gather(*(n.hello(timeout=10) for n in nodes))
            finally:
                agent.close()
                head.close()
                await serving
        return nodes

    with Lan(3) as lan:
        nodes = asyncio.run(scene(lan))
        try:
            assert [n.primed for n in nodes] == [1, 1, 0]   # the head's own DATA goes to its aggregator too
            deadline = time.monotonic() + 10
            while run_in(lan.workers[1], lambda: _neighbour(lan.worker_ip(0))) is None:
                assert time.monotonic() < deadline, "the member never resolved its aggregator's address"
                time.sleep(0.01)
            assert run_in(lan.workers[2], lambda: _neighbour(lan.worker_ip(0))) is None
        finally:
            for n in nodes:
                n.close()


@pytest.mark.bcc
@pytest.mark.parametrize("workers,clusters", [(2, None), (8, None), (5, "1:0,2;3:4")])
def test_results_from_the_kernel_exact_through_shadow_slots(gateway_program: Any, workers: int,
                                                           clusters: str | None) -> None:
    """The gateway's program sends every result itself (ALEPH's result path): 45 chunks per worker through 4
    shadow slots, numbered on across iterations, on one and two levels; every worker's result is numpy's. The
    program's own counters, read from its map in the kernel, show one completion and one fresh result per
    chunk and one report per iteration, and the gateway's sockets sent fewer datagrams than the run has
    results (control answers only): no result crossed into userspace."""
    topology = LanTopology.parse(clusters, workers) if clusters else None
    out = asyncio.run(run_lan("xdp", gateway_program, workers=workers, iterations=ITERATIONS, topology=topology,
                              sizes=LONG, kernel=True))
    chunks = layout(LONG).num_chunks
    assert out["checked"] == ITERATIONS
    st = out["stats"]
    assert st["complete"] == ITERATIONS * chunks, st
    assert st["iteration_done"] == ITERATIONS, st
    assert st["result"] >= ITERATIONS * chunks, st
    # results through userspace would be every iteration's every chunk; the rest are control answers, which
    # a busy host's repeated HELLOs and QUERYs multiply (58 against 45 chunks seen with both cores busy)
    assert out["udp_out"] < ITERATIONS * chunks, out["udp_out"]
    assert out["acks"] == 0 and out["streamed"] == 0


@pytest.mark.bcc
@pytest.mark.slow
def test_results_from_the_kernel_survive_loss_on_both_levels_and_the_result_path(gateway_program: Any,
                                                                                 tmp_path: Path) -> None:
    """1 % loss on every port of the bridge (DATA to the gateway and to the cluster's aggregator, and each
    copy of every result to each worker), 2 % duplicated DATA, authenticated: a worker that lost a result
    resends its DATA and the program sends the result again from the shadow slot that still holds it; every
    sum stays exact."""
    topology = LanTopology.parse("0:1,2", 5)
    out = asyncio.run(run_lan("xdp", gateway_program, workers=5, iterations=4, topology=topology, loss=0.01,
                              wire_loss=0.01, duplicate=0.02, tmp=tmp_path, secret=b"k" * 32, sizes=LONG,
                              kernel=True))
    st = out["stats"]
    assert out["checked"] == 4
    assert st["iteration_done"] == 4, st
    assert st["result"] > st["complete"], st    # results sent again: for a lost one, or a late duplicate
    assert out["retransmitted"] > 0
    # a worker's resend for a result it lost, after the iteration completed, still carries a valid token
    assert st["bad_token"] == 0, st


@pytest.mark.bcc
@pytest.mark.slow
def test_results_from_the_kernel_with_mixed_precisions_and_a_rescale(gateway_program: Any) -> None:
    """Workers at fp32, fp16, bf16 and int8 on two levels, one tensor whose sum leaves int32: the overflowed
    slot goes up to the agent (never out as a result), the agent has the workers re-quantise, and the
    program returns the rescaled slot; every result is numpy's, computed the same way."""
    precisions = [Precision.FIXED32, Precision.FP16, Precision.BF16, Precision.INT8, Precision.FP16]
    topology = LanTopology.parse("1:2,3", 5)
    out = asyncio.run(run_lan("xdp", gateway_program, workers=5, iterations=2, topology=topology,
                              precisions=precisions, kernel=True))
    assert out["checked"] == 2
    out = asyncio.run(run_lan("xdp", gateway_program, workers=4, iterations=1, big=True,
                              topology=LanTopology.parse("0:1,2", 4), kernel=True))
    assert out["checked"] == 1 and out["rescaled"] >= 4
    assert sum(s["overflow"] for s in (out["stats"], *out["cluster_stats"])) > 0


@pytest.mark.bcc
def test_results_from_the_kernel_a_silent_worker_is_a_named_timeout(gateway_program: Any) -> None:
    with pytest.raises(ExceptionGroup) as info:
        asyncio.run(run_lan("xdp", gateway_program, workers=3, iterations=1, silent=2, timeout=1.5, kernel=True))
    timeouts = [e for e in info.value.exceptions if isinstance(e, EdgeTimeout)]
    assert any("missing workers [2]" in str(e) for e in timeouts), info.value.exceptions
