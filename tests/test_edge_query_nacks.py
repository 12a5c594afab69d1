"""Loss recovery by NACKs of exactly the missing (``edge_query_nacks``), on both aggregation paths in
network namespaces: after one worker's DATA datagram is lost, the gateway sees the gap itself (a chunk
completed after it), or, for the iteration's last chunk, which nothing completes after, the workers' tail
probe asks about it (QUERY); the gateway reads the chunk's slot (the kernel's slot map, or the fallback's
slots) and NACKs only the worker missing from it, and only that worker resends; without the option workers
resend on their own timeouts (every one whose timeout runs out before the first resend's ACK comes). The
sums stay exact, and neither the slot timers nor the workers' stall rule (both far beyond the run) fire."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from tests.edge_programs import NACK_LAYOUT, nack_iterations, nack_program
from tests.lan_reference import fixed_point_sums

pytestmark = [pytest.mark.root, pytest.mark.slow]

LAYOUT = NACK_LAYOUT
JOB = 12
PORT = 9410
GROUP = ("239.77.0.12", 9411)
WORKERS = 4
LOSER = 1
EARLY, LATE, LAST = 2, 88, 89
"""Sequence numbers of the chunk whose first transmission by worker LOSER is dropped, in the two cases."""
_iterations = nack_iterations


@pytest.fixture(scope="module")
def xdp_program() -> Any:
    return nack_program()



async def one_loss(mode: str, xdp: Any, *, query_nacks: bool, lost: int) -> dict[str, Any]:
    """One iteration of WORKERS workers where worker LOSER's chunk ``lost`` is lost once; the slot timers are
    set far beyond the run (10 s) so only the workers' own detection recovers it."""
    from bpf.agent import EdgeAgent
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.emulation.netns import run_in
    from netstorm.lan.sender import EdgeSender

    rng = np.random.default_rng(5)
    contribs = [[rng.standard_normal(s).astype(np.float32) for s in LAYOUT.sizes] for _ in range(WORKERS)]
    with Lan(WORKERS) as lan:
        if xdp is not None:
            xdp.configure(job=JOB, port=PORT, expected=(1 << WORKERS) - 1, timeout=10.0, max_nacks=20)
            ifindex = lan.gateway_ifindex()
            run_in(lan.gateway, lambda: xdp.attach(ifindex))
        try:
            # a gap is asked about 0.3 s after the later chunk's ACK, and again 0.3 s later: without the
            # option, each worker resends its copy then
            agent = EdgeAgent(lan.udp_socket(lan.gateway, GATEWAY_IP, PORT), LAYOUT, workers=WORKERS, job=JOB,
                              mode=mode, xdp=xdp, slot_timeout=10.0, group=GROUP, retransmit=0.3,
                              query_nacks=query_nacks, secret=b"q" * 32)
            nodes = [EdgeSender(lan.udp_socket(ns, lan.worker_ip(i)), (GATEWAY_IP, PORT), worker=i, layout=LAYOUT,
                                job=JOB, secret=b"q" * 32, group_opener=lan.group_opener(ns))
                     for i, ns in enumerate(lan.workers)]
            nodes[LOSER].drop = frozenset({lost})
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(agent.run())
                try:
                    await asyncio.gather(*(n.hello(timeout=10) for n in nodes))
                    await agent.wait_workers(timeout=10)
                    iteration = next(_iterations)
                    pushes = [tg.create_task(n.push_pull(iteration, contribs[n.worker], timeout=30)) for n in nodes]
                    sums = await agent.collect(iteration, timeout=25)
                    await agent.send_results(iteration, sums, total=WORKERS)
                    results = [await task for task in pushes]
                finally:
                    agent.close()
                    await serving
            stats = xdp.stats() if xdp is not None else dict(agent.fallback.counters)  # type: ignore[union-attr]
            return {"sums": sums, "results": results, "stats": stats, "query_nacks": agent.query_nacks_sent,
                    "contribs": contribs, "dropped": [n.dropped for n in nodes],
                    "resent": [n.retransmitted for n in nodes], "queries": [n.queries for n in nodes],
                    "resent_by_nack": [n.resent_by_nack for n in nodes],
                    "tail_probes": [n.tail_probes for n in nodes], "stalls": [n.stall_resends for n in nodes]}
        finally:
            if xdp is not None:
                xdp.detach()
                xdp.require_tokens(0)


def exact(contribs: list[list[np.ndarray]]) -> list[np.ndarray]:
    return fixed_point_sums(contribs, LAYOUT.scales)


@pytest.mark.parametrize("lost", [EARLY, LATE, LAST], ids=["early-found-by-gateway", "late-found-by-gateway",
                                                           "last-found-by-tail-probe"])
def test_one_lost_datagram_is_resent_by_its_worker_only(mode: str, lost: int,
                                                       request: pytest.FixtureRequest) -> None:
    xdp = request.getfixturevalue("xdp_program") if mode == "xdp" else None
    out = asyncio.run(one_loss(mode, xdp, query_nacks=True, lost=lost))
    want = exact(out["contribs"])
    for got, ref in zip(out["sums"], want, strict=True):
        assert np.array_equal(got, ref)
    for result, total in out["results"]:
        assert total == WORKERS
        for got, ref in zip(result, want, strict=True):
            assert np.array_equal(got, ref)
    assert out["dropped"] == [1 if w == LOSER else 0 for w in range(WORKERS)]
    # a gap QUERY would come 0.3 s after the later ACK, a stall resend 1.2 s after the last ACK: neither did
    assert out["stalls"] == [0] * WORKERS
    assert sum(out["queries"]) == sum(out["tail_probes"])
    if lost == LAST:
        # nothing completed after it for the gateway to see: a worker's tail probe asked (the first answer
        # may settle it before the others ask)
        assert sum(out["tail_probes"]) >= 1
    # the gateway named the loser, who resent once, on that NACK; a probe that went out while another
    # worker's copy of the last chunk was still on its way may name that worker too, whose duplicate the
    # slot's bitmap drops (the sums above are exact)
    assert out["query_nacks"] >= 1
    assert out["resent"][LOSER] == 1 and all(r <= 1 for r in out["resent"])
    assert out["resent_by_nack"] == out["resent"]
    assert out["stats"]["timer_events"] == 0


def test_without_query_nacks_workers_resend_on_the_gap(mode: str, request: pytest.FixtureRequest) -> None:
    xdp = request.getfixturevalue("xdp_program") if mode == "xdp" else None
    out = asyncio.run(one_loss(mode, xdp, query_nacks=False, lost=EARLY))
    want = exact(out["contribs"])
    for got, ref in zip(out["sums"], want, strict=True):
        assert np.array_equal(got, ref)
    assert out["query_nacks"] == 0
    # the loser resent on its own gap rule, and so did every worker whose timeout ran out before the first
    # resend's ACK came (which ones depends on timing): a resend each, none on a NACK
    assert out["resent"][LOSER] == 1
    assert all(r <= 1 for r in out["resent"])
    assert out["resent_by_nack"] == [0] * WORKERS
    assert out["stats"]["timer_events"] == 0
