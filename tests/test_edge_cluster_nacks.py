"""Loss below a cluster aggregator (two-level LAN, ALEPH) in network namespaces, on both aggregation paths:
a member's run of DATA datagrams is lost on its way to its aggregator, in the middle of an iteration (the
gateway sees the gap once later chunks complete) or at its end (nothing completes after it: the workers'
tail probe asks). The gateway sees only that the cluster's aggregate is missing, so it NACKs the cluster's
aggregator service, which reads its own slot's contributor bitmap and NACKs exactly the member it lacks:
that member resends each lost chunk once and nobody else resends anything (the gateway used to NACK every
member that asked, whose copies the aggregator drops as duplicates, and its gap rule named nobody). The
sums stay exact; the slot timers are set beyond the run and the workers' stall rule does not fire."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from netstorm.lan.deploy import LanTopology
from netstorm.lan.header import Kind
from tests.dataplane import until
from tests.edge_programs import NACK_LAYOUT, LentPrograms, nack_iterations, nack_program
from tests.lan_reference import fixed_point_sums

pytestmark = [pytest.mark.root, pytest.mark.slow]

LAYOUT = NACK_LAYOUT
JOB = 14
PORT = 9470
GROUP = ("239.77.0.14", 9471)
WORKERS = 5
HEAD, LOSER = 1, 2
TOPOLOGY = LanTopology(WORKERS, {HEAD: (2, 3)})
"""Worker 1 aggregates itself and workers 2 and 3; workers 0 and 4 send to the gateway."""
MIDDLE = frozenset(range(20, 50))
TAIL = frozenset(range(60, 90))
_iterations = nack_iterations
ATTACH = "generic"
"""How the aggregator's program attaches to its LAN interface (the loopback device is always generic)."""


@pytest.fixture(scope="module", autouse=True)
def cluster_programs() -> Iterator[LentPrograms]:
    """The cluster aggregator of each XDP run borrows its program from one pool instead of compiling its
    own; ``nack_iterations`` rise from run to run."""
    import bpf.cluster

    lent = LentPrograms()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bpf.cluster, "XdpAggregator", lent)
        yield lent
    lent.release()


@pytest.fixture(scope="module")
def xdp_program() -> Any:
    return nack_program()



async def lost_below(mode: str, xdp: Any, lost: frozenset[int], *, forge: bool = False) -> dict[str, Any]:
    """One iteration in which member LOSER's first transmissions of the chunks ``lost`` are dropped; with
    ``forge``, forged datagrams reach the cluster's service and its members first (``forge_below``)."""
    from bpf.agent import EdgeAgent
    from bpf.cluster import ClusterAggregator
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.emulation.netns import run_in
    from netstorm.lan.sender import EdgeSender

    secret = b"c" * 32
    rng = np.random.default_rng(7)
    contribs = [[rng.standard_normal(s).astype(np.float32) for s in LAYOUT.sizes] for _ in range(WORKERS)]
    with Lan(WORKERS) as lan:
        if xdp is not None:
            xdp.configure(job=JOB, port=PORT, expected=TOPOLOGY.gateway_mask(), timeout=10.0, max_nacks=20)
            ifindex = lan.gateway_ifindex()
            run_in(lan.gateway, lambda: xdp.attach(ifindex))
        cluster = None
        try:
            agent = EdgeAgent(lan.udp_socket(lan.gateway, GATEWAY_IP, PORT), LAYOUT, workers=WORKERS, job=JOB,
                              mode=mode, xdp=xdp, slot_timeout=10.0, group=GROUP, retransmit=0.3,
                              topology=TOPOLOGY, secret=secret)
            nodes = [EdgeSender(lan.udp_socket(ns, lan.worker_ip(i)), (GATEWAY_IP, PORT), worker=i, layout=LAYOUT,
                                job=JOB, secret=secret, group_opener=lan.group_opener(ns))
                     for i, ns in enumerate(lan.workers)]
            nodes[LOSER].drop = lost
            iteration = next(_iterations)
            agent.expect(iteration)
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(agent.run())
                try:
                    ns = lan.workers[HEAD]
                    cluster = ClusterAggregator(lan.udp_socket(ns, lan.worker_ip(HEAD), PORT), (GATEWAY_IP, PORT),
                                                worker=HEAD, job=JOB, interface="eth0", mode=mode, secret=secret,
                                                group_opener=lan.group_opener(ns), attach=ATTACH)
                    await cluster.start(timeout=10, load_in=functools.partial(run_in, ns))
                    tg.create_task(cluster.run())
                    await asyncio.gather(*(n.hello(timeout=10) for n in nodes))
                    await agent.wait_workers(timeout=10)
                    cluster.follow(iteration)
                    forged = await forge_below(lan, cluster, nodes, iteration, secret) if forge else {}
                    pushes = [tg.create_task(n.push_pull(iteration, contribs[n.worker], timeout=30)) for n in nodes]
                    sums = await agent.collect(iteration, timeout=25)
                    await agent.send_results(iteration, sums, total=WORKERS)
                    results = [await task for task in pushes]
                finally:
                    agent.close()
                    stats = cluster.stats() if cluster is not None else {}
                    if cluster is not None:
                        cluster.close()
                    await serving
            return {"sums": sums, "results": results, "contribs": contribs, "cluster": stats, "forged": forged,
                    "member_forged": {n.worker: n.forged for n in nodes},
                    "cluster_nacks": agent.cluster_nacks_sent, "query_nacks": agent.query_nacks_sent,
                    "dropped": [n.dropped for n in nodes], "resent": [n.retransmitted for n in nodes],
                    "resent_by_nack": [n.resent_by_nack for n in nodes], "stalls": [n.stall_resends for n in nodes]}
        finally:
            for node in nodes if "nodes" in locals() else []:
                node.close()
            if xdp is not None:
                xdp.detach()
                xdp.require_tokens(0)


async def forge_below(lan: Any, cluster: Any, nodes: list[Any], iteration: int, secret: bytes) -> dict[Any, int]:
    """Before the iteration: the gateway's NACK to the cluster's service forged with every wrong token an
    attacker on the LAN can hold (none, a guess, the group's of the iteration before, the service's own
    worker token, a member's gateway token) from the gateway's host (whose address the service expects) and,
    with the right token, from a member's (a replay from elsewhere); QUERY, REPORT and FAILED, kinds the
    service never takes, to its socket; and NACKs listing every chunk and FAILED with wrong tokens to every
    member, from the aggregator's host. Waits until the service refused its NACKs; how many datagrams went to
    the service (key "service") and to each member (by worker)."""
    from netstorm.emulation.bridge_lan import GATEWAY_IP
    from netstorm.lan.packets import cluster_nack_packet, control_packet, nack_packets
    from netstorm.lan.tokens import LanTokens
    from netstorm.lan.udp import sendto

    tokens = LanTokens(secret, JOB)
    service = (lan.worker_ip(HEAD), PORT)
    members = [n for n in nodes if n.worker in TOPOLOGY.clusters[HEAD] or n.worker == HEAD]

    def wrong(worker: int) -> list[int]:
        other = next(w for w in TOPOLOGY.clusters[HEAD] if w != worker)
        return [0, 0x5EC12E7, tokens.group(iteration - 1), tokens.worker(worker, iteration),
                tokens.gateway(other, iteration)]

    nacks = [cluster_nack_packet(LAYOUT, seq, job=JOB, iteration=iteration, token=t)
             for t in wrong(HEAD) for seq in (0, LAYOUT.num_chunks - 1)]
    replayed = cluster_nack_packet(LAYOUT, 0, job=JOB, iteration=iteration, token=tokens.gateway(HEAD, iteration))
    strays = [control_packet(kind, job=JOB, worker=HEAD, iteration=iteration, token=t)
              for kind in (Kind.QUERY, Kind.REPORT, Kind.FAILED) for t in wrong(HEAD)]
    sent: dict[Any, int] = {"service": len(nacks) + 1}
    on_gateway = lan.udp_socket(lan.gateway, GATEWAY_IP)
    on_member = lan.udp_socket(lan.workers[LOSER], lan.worker_ip(LOSER))
    on_head = lan.udp_socket(lan.workers[HEAD], lan.worker_ip(HEAD))
    try:
        for datagram in [*nacks, *strays]:
            await sendto(on_gateway, datagram, service)
        await sendto(on_member, replayed, service)
        for node in members:
            down = [datagram for t in wrong(node.worker)
                    for datagram in (*nack_packets(np.arange(LAYOUT.num_chunks), job=JOB, iteration=iteration,
                                                   token=t),
                                     control_packet(Kind.FAILED, job=JOB, worker=node.worker, iteration=iteration,
                                                    token=t))]
            for datagram in down:
                await sendto(on_head, datagram, node.sock.getsockname())
            sent[node.worker] = len(down)
        await until(lambda: cluster.forged >= sent["service"], "the service refusing forged NACKs")
    finally:
        for sock in (on_gateway, on_member, on_head):
            sock.close()
    return sent


def exact(contribs: list[list[np.ndarray]]) -> list[np.ndarray]:
    return fixed_point_sums(contribs, LAYOUT.scales)


@pytest.mark.parametrize("lost", [MIDDLE, TAIL], ids=["middle-found-by-gateway", "tail-found-by-probe"])
def test_a_members_lost_run_is_resent_by_that_member_only(mode: str, lost: frozenset[int],
                                                          request: pytest.FixtureRequest) -> None:
    xdp = request.getfixturevalue("xdp_program") if mode == "xdp" else None
    out = asyncio.run(lost_below(mode, xdp, lost))
    want = exact(out["contribs"])
    for got, ref in zip(out["sums"], want, strict=True):
        assert np.array_equal(got, ref)
    for result, total in out["results"]:
        assert total == WORKERS
        for got, ref in zip(result, want, strict=True):
            assert np.array_equal(got, ref)
    assert out["dropped"] == [len(lost) if w == LOSER else 0 for w in range(WORKERS)]
    # the gateway asked the cluster's aggregator, which named the loser alone: each lost chunk resent once, on
    # a NACK, and no other worker resent anything
    assert out["resent"] == [len(lost) if w == LOSER else 0 for w in range(WORKERS)]
    assert out["resent_by_nack"] == out["resent"]
    assert out["stalls"] == [0] * WORKERS
    assert out["query_nacks"] == 0        # no unclustered worker lost anything
    assert out["cluster_nacks"] >= 1 and out["cluster"]["cluster_nacks_out"] >= len(lost)
    assert out["cluster"]["cluster_forged"] == 0


def test_forged_nacks_and_stray_kinds_below_an_aggregator_change_nothing(mode: str,
                                                                         request: pytest.FixtureRequest) -> None:
    """The gateway's NACK to a cluster's service, forged with any wrong token or replayed from another address,
    is counted and dropped (accepted, it would make the service NACK members whose slot is empty: every
    one); QUERY, REPORT and FAILED sent to the service change nothing; NACKs and FAILED forged to the
    members are counted and dropped by each. Nobody resends, the service NACKs nobody, and the sums and
    results stay exact."""
    xdp = request.getfixturevalue("xdp_program") if mode == "xdp" else None
    out = asyncio.run(lost_below(mode, xdp, frozenset(), forge=True))
    want = exact(out["contribs"])
    for got, ref in zip(out["sums"], want, strict=True):
        assert np.array_equal(got, ref)
    for result, total in out["results"]:
        assert total == WORKERS
        for got, ref in zip(result, want, strict=True):
            assert np.array_equal(got, ref)
    assert out["cluster"]["cluster_forged"] == out["forged"]["service"]
    assert out["cluster"]["cluster_nacks_out"] == 0
    for worker, count in out["forged"].items():
        if worker != "service":
            assert out["member_forged"][worker] == count
    assert out["resent"] == [0] * WORKERS and out["stalls"] == [0] * WORKERS
