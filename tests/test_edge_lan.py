"""A gateway and 2-8 LAN workers on a bridge in network namespaces, on both aggregation paths: exact sums
over iterations and chunks, loss recovered through the slot timer, duplicates ignored, overflow recovered,
and a silent worker reported by name instead of hanging."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Iterator
from typing import Any

import numpy as np
import pytest

from netstorm.errors import NetStormError
from netstorm.lan.errors import EdgeTimeout, IterationAborted
from netstorm.lan.fixedpoint import rescale_for
from netstorm.lan.layout import EdgeLayout

pytestmark = [pytest.mark.root, pytest.mark.slow]

LAYOUT = EdgeLayout.uniform([5000, 1234, 7], scale=16, lanes=357)
JOB = 11
PORT = 9400
GROUP = ("239.77.0.9", 9401)
_iterations = itertools.count(100, 10)


@pytest.fixture(scope="module")
def xdp_program() -> Iterator[Any]:
    from bpf.xdp import XdpAggregator

    agg = XdpAggregator(LAYOUT, job=JOB, port=PORT, expected=1, timeout=0.1)
    yield agg
    agg.close()



def quantised(values: np.ndarray, scale: int) -> np.ndarray:
    return np.rint(values.astype(np.float64) * 2.0**scale).astype(np.int64)


def reference(contribs: list[list[np.ndarray]], workers: int) -> list[np.ndarray]:
    """Exact LAN sums: per chunk the int64 sum at the layout's scale, or at the rescaled scale where that
    overflows int32 (the recovery the gateway runs)."""
    out = []
    for t, size in enumerate(LAYOUT.sizes):
        result = np.zeros(size, np.float32)
        for c in range(LAYOUT.chunks[t]):
            a, b = LAYOUT.bounds(t, c)
            parts = [w[t][a:b] for w in contribs]
            scale = LAYOUT.scales[t]
            total = np.sum([quantised(p, scale) for p in parts], axis=0)
            if np.any(np.abs(total) > 2**31 - 1) or any(np.any(np.abs(quantised(p, scale)) > 2**31 - 1)
                                                         for p in parts):
                from netstorm.lan.packets import fit_scales

                need = min(int(fit_scales(p.reshape(1, -1).astype(np.float64))[0]) for p in parts)
                scale = rescale_for(need, workers)
                total = np.sum([quantised(p, scale) for p in parts], axis=0)
            result[a:b] = (total.astype(np.float64) * 2.0**-scale).astype(np.float32)
        out.append(result)
    return out


async def _outcome(push: Awaitable[Any]) -> Any:
    """A push's result, or its typed error returned (a task that raised would end the TaskGroup)."""
    try:
        return await push
    except NetStormError as exc:
        return exc


async def run_lan(mode: str, xdp_program: Any, *, workers: int, iterations: int, loss: float = 0.0,
                  duplicate: float = 0.0, silent: int | None = None, big: bool = False,
                  timeout: float = 20.0, secret: bytes | None = None,  # noqa: ASYNC109
                  group: tuple[str, int] | None = GROUP, lost: int | None = None,
                  query_nacks: bool = True) -> dict[str, Any]:
    """``lost``: the iteration (0-based) in which the last worker's DATA never leaves; it is failed as the
    node fails it (``EdgeAgent.fail``), every worker must end it with ``IterationAborted``, and the next
    iterations must be exact."""
    from bpf.agent import EdgeAgent
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.emulation.netns import run_in
    from netstorm.lan.sender import EdgeSender

    rng = np.random.default_rng(workers * 7 + iterations)
    with Lan(workers) as lan:
        xdp = None
        if mode == "xdp":
            xdp = xdp_program
            xdp.configure(job=JOB, port=PORT, expected=(1 << workers) - 1, timeout=0.1, max_nacks=20)
            ifindex = lan.gateway_ifindex()
            attached = run_in(lan.gateway, lambda: xdp.attach(ifindex))
        try:
            agent = EdgeAgent(lan.udp_socket(lan.gateway, GATEWAY_IP, PORT), LAYOUT, workers=workers,
                              job=JOB, mode=mode, xdp=xdp, slot_timeout=0.1, secret=secret, group=group,
                              retransmit=1.0,   # workers wait longer than the slot timer: NACKs recover
                              query_nacks=query_nacks)
            nodes = [EdgeSender(lan.udp_socket(ns, lan.worker_ip(i)), (GATEWAY_IP, PORT), worker=i, layout=LAYOUT,
                                job=JOB, loss=loss, seed=3, secret=secret, group_opener=lan.group_opener(ns))
                     for i, ns in enumerate(lan.workers)]
            for node in nodes:
                node.duplicate = duplicate
            checked = aborted = 0
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(agent.run())
                try:
                    await asyncio.gather(*(n.hello(timeout=10) for n in nodes))
                    await agent.wait_workers(timeout=10)
                    # garbage and a foreign job's datagram: rejected with a logged reason, nothing else lost
                    from netstorm.lan.header import Kind
                    from netstorm.lan.packets import control_packet
                    from netstorm.lan.udp import sendto

                    await sendto(nodes[0].sock, b"not an edge datagram", (GATEWAY_IP, PORT))
                    await sendto(nodes[0].sock, control_packet(Kind.PULL, job=JOB + 1, worker=0), (GATEWAY_IP, PORT))
                    first = next(_iterations)
                    for k in range(iterations):
                        iteration = first + k
                        contribs = [[rng.standard_normal(s).astype(np.float32) for s in LAYOUT.sizes]
                                    for _ in range(workers)]
                        if big:
                            for w in contribs:
                                w[2][:] = 2.0**15 * 0.75   # each fits at scale 16, the sum of several does not
                        active = [n for n in nodes if n.worker != silent]
                        if lost == k:
                            nodes[-1].silent = frozenset({iteration})
                            pushes = [tg.create_task(_outcome(n.push_pull(iteration, contribs[n.worker],
                                                                          timeout=60)))
                                      for n in active]
                            with pytest.raises(EdgeTimeout, match=f"missing workers \\[{workers - 1}\\]"):
                                await agent.collect(iteration, timeout=timeout)
                            agent.fail(iteration)   # what the node does: the workers end it at once
                            for task in pushes:
                                assert isinstance(await task, IterationAborted)
                            aborted += 1
                            continue
                        pushes = [tg.create_task(n.push_pull(iteration, contribs[n.worker], timeout=timeout + 5))
                                  for n in active]
                        sums = await agent.collect(iteration, timeout=timeout)
                        expected = reference(contribs, workers)
                        for got, want in zip(sums, expected, strict=True):
                            assert np.array_equal(got, want)
                        total = workers + 1 + k   # what the node would say: this LAN, its trainer, other DCs
                        await agent.send_results(iteration, sums, total=total)
                        for task in pushes:
                            got_sums, got_total = await task
                            assert got_total == total
                            for got, want in zip(got_sums, expected, strict=True):
                                assert np.array_equal(got, want)
                        checked += 1
                finally:
                    agent.close()
                    await serving
            stats = xdp.stats() if xdp is not None else dict(agent.fallback.counters)  # type: ignore[union-attr]
            return {"checked": checked, "aborted": aborted, "stats": stats, "rejected": agent.errors,
                    "bad_tokens": agent.bad_tokens,
                    "dropped": sum(n.dropped for n in nodes),
                    "retransmitted": sum(n.retransmitted for n in nodes),
                    "rescaled": sum(n.rescaled for n in nodes), "mode": attached if xdp is not None else "userspace"}
        finally:
            if xdp is not None:
                xdp.detach()
                xdp.require_tokens(0)


@pytest.mark.parametrize("secret", [None, b"s" * 32], ids=["no-secret", "secret"])
def test_exact_sums_with_eight_workers_under_loss_and_duplicates(mode: str, secret: bytes | None,
                                                                 request: pytest.FixtureRequest) -> None:
    xdp = request.getfixturevalue("xdp_program") if mode == "xdp" else None
    # without the gateway's gap rule, so the slot timers recover what the tail probes do not
    out = asyncio.run(run_lan(mode, xdp, workers=8, iterations=3, loss=0.05, duplicate=0.05, secret=secret,
                              query_nacks=False))
    assert out["checked"] == 3
    assert out["bad_tokens"] == 0   # the workers' own datagrams, NACK answers included, all carry good tokens
    assert out["rejected"] == 2
    assert out["dropped"] > 0 and out["retransmitted"] >= out["dropped"]
    # the timer path did the recovery, and duplicates were seen and ignored
    assert out["stats"]["timer_events"] > 0
    assert out["stats"]["dup"] > 0
    assert out["stats"].get("timer_fail", 0) == 0


@pytest.mark.parametrize("secret", [None, b"s" * 32], ids=["no-secret", "secret"])
def test_overflow_is_recovered_by_rescaling(mode: str, secret: bytes | None, request: pytest.FixtureRequest) -> None:
    xdp = request.getfixturevalue("xdp_program") if mode == "xdp" else None
    out = asyncio.run(run_lan(mode, xdp, workers=3, iterations=1, big=True, secret=secret))
    assert out["checked"] == 1 and out["rescaled"] == 3


@pytest.mark.parametrize(("secret", "group"), [(None, GROUP), (b"s" * 32, None)], ids=["group", "unicast-secret"])
def test_a_failed_iteration_ends_at_every_worker_with_the_gateways_notice_and_the_next_is_exact(
        mode: str, secret: bytes | None, group: tuple[str, int] | None, request: pytest.FixtureRequest) -> None:
    """The last worker's uplink is lost for iteration 1: the gateway's collect names it, the iteration is
    failed, and both workers end it with ``IterationAborted`` from the FAILED notice (multicast, or a
    unicast copy each carrying the worker's token), not at their 60 s timeout; iterations 0 and 2 are exact."""
    xdp = request.getfixturevalue("xdp_program") if mode == "xdp" else None
    out = asyncio.run(run_lan(mode, xdp, workers=2, iterations=3, lost=1, timeout=2.0, secret=secret, group=group))
    assert out["checked"] == 2 and out["aborted"] == 1
    assert out["bad_tokens"] == 0


def test_silent_worker_is_a_named_timeout_not_a_hang(mode: str, request: pytest.FixtureRequest) -> None:
    xdp = request.getfixturevalue("xdp_program") if mode == "xdp" else None
    with pytest.raises(ExceptionGroup) as info:
        asyncio.run(run_lan(mode, xdp, workers=2, iterations=1, silent=1, timeout=1.5))
    errors = info.value.exceptions
    timeouts = [e for e in errors if isinstance(e, EdgeTimeout)]
    assert timeouts, errors
    assert any("missing workers [1]" in str(e) for e in timeouts), [str(e) for e in timeouts]
