"""FediAC's rounds on the LAN tier, in network namespaces on both aggregation paths: 2-4 LAN workers run the
same ``Rounds`` as the gateway's trainer, push votes, the scale one-hot and b-bit values as exact integer
lanes on per-round wires (the values only up to the GIA's size), and the DC's sum (the LAN's plus the
gateway trainer's) equals the numpy sum of every contributor's tensors exactly, under loss; every worker
ends each iteration with the same GIA and the same decoded sum as a reference run of the same contributors.
Results come back narrow (the GIA as a bitmap, the sums as the narrowest integers), counted against what
float32 lanes would take; with ``fediac_gia_reuse`` the reused iterations run one values round each, the
GIA the same at every contributor. A contributor whose integers outgrow the round's int8 lanes sends on
wider ones and the sum stays exact; an integer sum beyond int32 is flagged by the aggregator and fails the
iteration instead of being rescaled; a round that fails (a worker's uplink lost for it) ends at every
contributor with a typed error, and the later rounds are exact again."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from netstorm.compression.options import VALUES, VOTES, CompressionOptions
from netstorm.compression.session import Rounds
from netstorm.errors import NetStormError
from netstorm.lan.errors import EdgeTimeout, IntegerOverflow, IterationAborted
from netstorm.lan.header import HEADER_BYTES, Precision
from netstorm.lan.introunds import GatewayRounds, Kind, RoundPlan, gia_size, layout_order
from netstorm.lan.layout import EdgeLayout

pytestmark = [pytest.mark.root, pytest.mark.slow]

MODEL = {"a.weight": (40, 30), "b.bias": (37,)}   # 1237 elements: 4 value chunks at most, 4 + 3 vote chunks
OPTIONS = CompressionOptions("fediac", k=0.1, bits=10, votes=2)
"""b = 10: the values travel as int32 lanes, the votes as int8 ones; ``bits=8`` sends both narrow."""
LANES = 357
POOL = 3
"""Fewer slots than a vote round's chunks: the pool cycles within every round."""
JOB = 12
PORT = 9420
GROUP = ("239.77.0.12", 9421)
SEED = 5
_iterations = itertools.count(300, 20)


def model() -> dict[str, np.ndarray]:
    return {name: np.zeros(shape, np.float32) for name, shape in MODEL.items()}


def full_layout() -> EdgeLayout:
    """What the gateway loads: every registered tensor (model and integer ones), as the node registers them."""
    registered = Rounds(OPTIONS, model()).registered(model())
    return EdgeLayout.uniform([registered[n].size for n in layout_order(registered)], scale=16, lanes=LANES,
                              pool=POOL)


@pytest.fixture(scope="module")
def xdp_program() -> Iterator[Any]:
    from bpf.xdp import XdpAggregator

    agg = XdpAggregator(full_layout(), job=JOB, port=PORT, expected=1, timeout=0.1)
    yield agg
    agg.close()



def flat(tensors: dict[str, np.ndarray], names: list[str]) -> list[np.ndarray]:
    return [np.asarray(tensors[n]).reshape(-1).astype(np.int64 if np.asarray(tensors[n]).dtype.kind in "iu"
                                                         else np.float64) for n in names]


async def outcome(push: Awaitable[dict[str, np.ndarray]]) -> dict[str, np.ndarray] | NetStormError:
    """A LAN worker's push_pull, its typed error returned rather than raised (a task that raised would end
    the harness's TaskGroup)."""
    try:
        return await push
    except NetStormError as exc:
        return exc


async def run_fediac(mode: str, xdp_program: Any, *, workers: int, iterations: int, loss: float = 0.0,
                     bits: int = 10, reuse: int = 1, downlink_loss: float = 0.0,
                     tmp: Path | None = None, fail: tuple[int, int] | None = None) -> dict[str, Any]:
    """``fail``: (step, round) in which LAN worker 0's uplink fails for the whole round (its DATA never
    leaves): the gateway's collect times out, the harness fails the iteration as the node would
    (``GatewayRounds.failed``, ``EdgeAgent.fail``), every contributor must end that step with a typed error
    and undo it, and the later steps must still be exact."""
    from bpf.agent import EdgeAgent
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.emulation.netns import run_in
    from netstorm.lan.compressed import CompressedEdgeWorker
    from netstorm.lan.sender import EdgeSender

    layout = full_layout()
    options = dataclasses.replace(OPTIONS, bits=bits, gia_reuse=reuse)
    contributors = workers + 1
    rng = np.random.default_rng(workers * 11 + iterations)
    with Lan(workers) as lan:
        if downlink_loss:
            from netstorm.emulation import lossfilter

            # the bridge's port towards each worker: its results (and ACKs, NACKs) are lost, and PULLed back
            assert tmp is not None
            lossfilter.attach({(lan.bridge, f"w{i}"): downlink_loss for i in range(workers)}, tmp / "bpf")
        xdp = None
        if mode == "xdp":
            xdp = xdp_program
            xdp.configure(job=JOB, port=PORT, expected=(1 << workers) - 1, timeout=0.1, max_nacks=20)
            ifindex = lan.gateway_ifindex()
            run_in(lan.gateway, lambda: xdp.attach(ifindex))
        try:
            agent = EdgeAgent(lan.udp_socket(lan.gateway, GATEWAY_IP, PORT), layout, workers=workers, job=JOB,
                              mode=mode, xdp=xdp, slot_timeout=0.1, group=GROUP, retransmit=0.05)
            clients = [CompressedEdgeWorker(
                EdgeSender(lan.udp_socket(ns, lan.worker_ip(i)), (GATEWAY_IP, PORT), worker=i,
                           layout=EdgeLayout.uniform([1], scale=0, lanes=LANES), job=JOB, loss=loss, seed=3,
                           group_opener=lan.group_opener(ns)),
                options, contributor=1 + i, seed=SEED, applied=0, timeout=30.0) for i, ns in enumerate(lan.workers)]
            # the gateway's trainer (contributor 0), and a reference run of every LAN worker's rounds
            trainer = Rounds(options, model(), SEED)
            registered = trainer.registered(model())
            names = list(layout_order(registered))
            reference = [Rounds(options, model(), SEED) for _ in range(workers)]
            for i, ref in enumerate(reference):
                ref.registered(model())
                ref.start(contributors, 1 + i)
            trainer.start(contributors, 0)
            plan = RoundPlan(registered, options, lanes=LANES, pool=layout.num_slots, scale=16,
                             contributors=contributors)
            checked: dict[str, int] = {"votes": 0, "values": 0, "reused": 0, "aborted": 0}
            gias: list[int] = []
            result_bytes: dict[str, list[tuple[int, int]]] = {"votes": [], "values": [], "reused": []}
            """Per round kind: (bytes the gateway queued for the result, what float32 lanes would take)."""
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(agent.run())
                try:
                    inits = [tg.create_task(c.init(model())) for c in clients]
                    await agent.wait_workers(timeout=10)
                    first = next(_iterations)
                    gateway = GatewayRounds(plan, first + 1)
                    wire = gateway.wire_of(first + 1)
                    agent.plan(first + 1, wire.layout, integer=wire.integer, back=wire.back)
                    await agent.send_results(first, [np.zeros(s, np.float32) for s in layout.sizes],
                                             total=contributors, unicast=True)
                    for task in inits:
                        await task
                    iteration = first + 1
                    for step_no in range(iterations):
                        grads = [{n: rng.standard_normal(s).astype(np.float32) for n, s in MODEL.items()}
                                 for _ in range(contributors)]
                        failing = fail is not None and fail[0] == step_no
                        if fail is not None and failing:
                            clients[0].sender.silent = frozenset({iteration + fail[1]})
                        pushes = [tg.create_task(outcome(c.push_pull(grads[1 + i]))) for i, c in enumerate(clients)]
                        steps = [trainer.iteration(grads[0])] + [r.iteration(grads[1 + i])
                                                                 for i, r in enumerate(reference)]
                        sent = [next(s) for s in steps]
                        decoded: list[dict[str, np.ndarray]] = []
                        while True:
                            wire = gateway.wire_of(iteration)
                            if failing and iteration in clients[0].sender.silent:
                                with pytest.raises(EdgeTimeout, match="missing"):
                                    await agent.collect(iteration, timeout=2)
                                # what the node does: the next iteration restarts the rounds, the LAN is told
                                restart = gateway.failed(iteration)
                                assert restart is not None and restart.kind is Kind.VOTES
                                agent.plan(iteration + 1, restart.layout, integer=restart.integer,
                                           back=restart.back)
                                agent.fail(iteration)
                                iteration += 1
                                for core in [trainer, *reference]:
                                    core.abort()
                                break
                            lan_sums = await agent.collect(iteration, timeout=30)
                            lan_full = gateway.contribution(iteration, lan_sums)
                            mine = flat(sent[0], names)
                            dc = [lan_full[t].astype(np.float64) + mine[t] for t in range(len(names))]
                            # the node's input: exact integer sums of the LAN workers' and the trainer's tensors
                            want = [np.sum([flat(p, names)[t] for p in sent], axis=0) for t in range(len(names))]
                            for t, name in enumerate(names):
                                if registered[name].dtype.kind in "iu":
                                    assert np.array_equal(dc[t], want[t].astype(np.float64)), (name, wire.kind)
                            checked[wire.kind.value] += 1
                            result = [np.asarray(d, np.float32) for d in dc]
                            back, following = gateway.released(iteration, result)
                            agent.plan(iteration + 1, following.layout, integer=following.integer,
                                       back=following.back)
                            queued = agent.outbox.bulk_bytes_queued
                            await agent.send_results(iteration, back, total=contributors)
                            result_bytes[wire.kind.value].append((
                                agent.outbox.bulk_bytes_queued - queued,
                                sum(HEADER_BYTES + 4 * e for e in wire.extents)))
                            iteration += 1
                            shaped = plan.shaped(result, registered)
                            nexts = []
                            for s in steps:
                                try:
                                    nexts.append(s.send(shaped))
                                except StopIteration as done:
                                    decoded.append(done.value)
                            if decoded:
                                break
                            if wire.kind is Kind.VOTES:
                                g = gia_size(shaped[VOTES], options.votes_of(contributors))
                                assert following.gia == g and following.layout.sizes == (max(1, g),)
                                gias.append(g)
                            sent = nexts
                        if failing:
                            # every LAN worker (the silent one too) ends the step with the gateway's word
                            for push in pushes:
                                assert isinstance(await push, IterationAborted)
                            checked["aborted"] += 1
                            continue
                        if wire.kind is Kind.REUSED:   # one round: values at the kept GIA and the scale
                            assert wire.gia == gias[-1]
                        for i, push in enumerate(pushes):
                            got = await push
                            assert isinstance(got, dict), got
                            for name in MODEL:
                                assert np.array_equal(got[name], decoded[1 + i][name]), name
                                assert np.array_equal(got[name], decoded[0][name]), name
                            assert clients[i].last.gia == trainer.last.gia == gias[-1]
                            assert clients[i].last.reused == trainer.last.reused
                            if trainer.last.reused:
                                (reused_wire, _), = clients[i].received
                                assert reused_wire.kind is Kind.REUSED and reused_wire.gia == gias[-1]
                                continue
                            # every worker read the same GIA and carried only its lanes
                            votes_wire, votes_back = clients[i].received[0]
                            values_wire, _ = clients[i].received[1]
                            assert votes_wire.kind is Kind.VOTES and values_wire.kind is Kind.VALUES
                            assert votes_wire.precision is Precision.INT8
                            assert values_wire.precision is (Precision.INT8 if bits <= 8 else Precision.FIXED32)
                            assert values_wire.gia == gias[-1] == clients[i].last.gia
                            assert values_wire.layout.num_chunks == -(-max(1, values_wire.gia) // LANES)
                            # the GIA came back as a bitmap: 0/1, the same at every worker, of the GIA's size
                            gia = votes_back[votes_wire.tensors.index(names.index(VOTES))]
                            first_gia = clients[0].received[0][1][votes_wire.tensors.index(names.index(VOTES))]
                            assert np.array_equal(gia, first_gia) and set(np.unique(gia)) <= {0, 1}
                            assert int(gia.sum()) == gias[-1]
                finally:
                    for c in clients:
                        c.sender.close()
                    agent.close()
                    await serving
            stats = xdp.stats() if xdp is not None else dict(agent.fallback.counters)  # type: ignore[union-attr]
            return {**checked, "gia": gias, "stats": stats, "dropped": sum(c.sender.dropped for c in clients),
                    "result_bytes": result_bytes, "pulls": sum(c.sender.pulls for c in clients),
                    "retransmitted": sum(c.sender.retransmitted for c in clients),
                    "values_lanes": names.index(VALUES)}
        finally:
            if xdp is not None:
                xdp.detach()


@pytest.mark.parametrize(("workers", "bits"), [(2, 10), (3, 8), (4, 10)])
def test_exact_integer_rounds_across_lan_workers_and_the_gateway_trainer(mode: str, workers: int, bits: int,
                                                                         request: pytest.FixtureRequest) -> None:
    xdp = request.getfixturevalue("xdp_program") if mode == "xdp" else None
    out = asyncio.run(run_fediac(mode, xdp, workers=workers, iterations=3, loss=0.05, bits=bits))
    assert out["votes"] == 3 and out["values"] == 3
    assert all(0 < g < 1237 for g in out["gia"])   # a real sparsification, not all or nothing
    assert out["dropped"] > 0 and out["retransmitted"] > 0
    # the aggregator completed the rounds' slots itself (the kernel's counters on the XDP path)
    assert out["stats"]["complete"] >= 3 * (4 + 3 + 1)
    # results came back narrow: the votes round's as two bitmaps of a datagram each (1237 and 768 elements),
    # the values' sums at 8 bits (b = 8: |sum| < 2**7) or 16, never float32's 4 bytes a lane
    for sent, float32 in out["result_bytes"]["votes"]:
        assert sent == 2 * HEADER_BYTES + 155 + 96 and float32 == 2 * HEADER_BYTES + 4 * (1237 + 768)
    for (sent, float32), g in zip(out["result_bytes"]["values"], out["gia"], strict=True):
        assert sent <= -(-g // LANES) * HEADER_BYTES + g * (1 if bits <= 8 else 2) and sent < float32


@pytest.mark.parametrize("reuse", [2, 3])
def test_a_reused_gia_runs_values_rounds_alone_on_the_lan(mode: str, reuse: int, tmp_path: Path,
                                                          request: pytest.FixtureRequest) -> None:
    """``fediac_gia_reuse``: after each vote, reuse - 1 iterations send only values and the scale one-hot at
    the kept GIA, summed exactly under loss both ways; every worker decodes what the reference run decodes,
    the narrow results it lost PULLed back."""
    xdp = request.getfixturevalue("xdp_program") if mode == "xdp" else None
    out = asyncio.run(run_fediac(mode, xdp, workers=3, iterations=2 * reuse, loss=0.05, bits=10, reuse=reuse,
                                 downlink_loss=0.15, tmp=tmp_path))
    assert out["votes"] == out["values"] == 2 and out["reused"] == 2 * (reuse - 1)
    assert out["dropped"] > 0 and out["pulls"] > 0
    for sent, float32 in out["result_bytes"]["reused"]:   # the sums as integers, the scale as a bitmap
        assert sent < float32 / 2


@pytest.mark.parametrize("fail_round", [0, 1], ids=["votes", "values"])
def test_a_failed_round_ends_everywhere_with_a_typed_error_and_later_steps_are_exact(
        mode: str, fail_round: int, request: pytest.FixtureRequest) -> None:
    """Worker 0's uplink fails for a whole round of step 1: the gateway's collect names it missing, the
    iteration is failed as the node fails it, every LAN worker ends the step with ``IterationAborted`` (the
    gateway's FAILED notice, not its own 30 s timeout), every contributor undoes the step, and steps 2 and 3
    run on the restarted wires with every round's integer sums exact against numpy, the same GIA and the
    same decoded sum at every contributor as a reference run that also undid step 1."""
    xdp = request.getfixturevalue("xdp_program") if mode == "xdp" else None
    out = asyncio.run(run_fediac(mode, xdp, workers=2, iterations=4, fail=(1, fail_round)))
    assert out["aborted"] == 1
    assert out["votes"] == 3 + fail_round and out["values"] == 3
    assert all(0 < g < 1237 for g in out["gia"])


async def run_overflow(mode: str, xdp_program: Any) -> dict[str, int]:
    from bpf.agent import EdgeAgent
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.emulation.netns import run_in
    from netstorm.lan.sender import EdgeSender

    layout = full_layout()
    wire = EdgeLayout((LANES,), (0,), lanes=LANES, pool=POOL)
    with Lan(3) as lan:
        xdp = None
        if mode == "xdp":
            xdp = xdp_program
            xdp.configure(job=JOB, port=PORT, expected=0b111, timeout=0.1, max_nacks=20)
            ifindex = lan.gateway_ifindex()
            run_in(lan.gateway, lambda: xdp.attach(ifindex))
        try:
            agent = EdgeAgent(lan.udp_socket(lan.gateway, GATEWAY_IP, PORT), layout, workers=3, job=JOB,
                              mode=mode, xdp=xdp, slot_timeout=0.1, retransmit=0.05)
            senders = [EdgeSender(lan.udp_socket(ns, lan.worker_ip(i)), (GATEWAY_IP, PORT), worker=i,
                                  layout=layout, job=JOB) for i, ns in enumerate(lan.workers)]
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(agent.run())
                try:
                    await asyncio.gather(*(s.hello(timeout=10) for s in senders))
                    iteration = next(_iterations)
                    agent.plan(iteration, wire, integer=True)
                    for s in senders:
                        s.layout = wire
                    # each lane fits int32 at scale 0; three of them do not
                    lanes = np.full(LANES, 2.0**30, np.float32)
                    pushes = [tg.create_task(s.push_pull(iteration, [lanes], timeout=3)) for s in senders]
                    with pytest.raises(IntegerOverflow):
                        await agent.collect(iteration, timeout=10)
                    for task in pushes:
                        task.cancel()
                finally:
                    for s in senders:
                        s.close()
                    agent.close()
                    await serving
            return xdp.stats() if xdp is not None else dict(agent.fallback.counters)  # type: ignore[union-attr]
        finally:
            if xdp is not None:
                xdp.detach()


def test_integer_overflow_is_flagged_and_fails_the_iteration(mode: str, request: pytest.FixtureRequest) -> None:
    xdp = request.getfixturevalue("xdp_program") if mode == "xdp" else None
    stats = asyncio.run(run_overflow(mode, xdp))
    assert stats["overflow"] > 0   # flagged by the aggregator's own check, as on the fixed-point path


async def run_widening(mode: str, xdp_program: Any) -> dict[str, Any]:
    """Three LAN workers push one integer round on an int8 wire at scale 0; worker 1's integers reach 1500
    and worker 2's 100000, past what int8 lanes carry: each of those pushes goes wider (fp16, int32 lanes)
    while worker 0's stays int8, the slots add the mix, and the sum is numpy's exactly."""
    from bpf.agent import EdgeAgent
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.emulation.netns import run_in
    from netstorm.lan.sender import EdgeSender

    layout = full_layout()
    wire = EdgeLayout((2 * LANES + 10, 20), (0, 0), lanes=LANES, pool=POOL)
    rng = np.random.default_rng(77)
    peaks = (100, 1500, 100_000)
    values = [[rng.integers(-p, p + 1, size).astype(np.float32) for size in wire.sizes] for p in peaks]
    for w, p in zip(values, peaks, strict=True):
        w[0][5] = p   # each worker's peak is reached
    want = [np.sum([w[t].astype(np.int64) for w in values], axis=0) for t in range(len(wire.sizes))]
    with Lan(3) as lan:
        xdp = None
        before: dict[str, int] = {}
        if mode == "xdp":
            xdp = xdp_program
            before = xdp.stats()   # the module's program: its counters hold the other tests' runs too
            xdp.configure(job=JOB, port=PORT, expected=0b111, timeout=0.1, max_nacks=20)
            ifindex = lan.gateway_ifindex()
            run_in(lan.gateway, lambda: xdp.attach(ifindex))
        try:
            agent = EdgeAgent(lan.udp_socket(lan.gateway, GATEWAY_IP, PORT), layout, workers=3, job=JOB,
                              mode=mode, xdp=xdp, slot_timeout=0.1, retransmit=0.05)
            senders = [EdgeSender(lan.udp_socket(ns, lan.worker_ip(i)), (GATEWAY_IP, PORT), worker=i,
                                  layout=layout, job=JOB) for i, ns in enumerate(lan.workers)]
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(agent.run())
                try:
                    await asyncio.gather(*(s.hello(timeout=10) for s in senders))
                    iteration = next(_iterations)
                    agent.plan(iteration, wire, integer=True)
                    for s in senders:
                        s.layout, s.precision, s.integers = wire, Precision.INT8, True
                    pushes = [tg.create_task(s.push_pull(iteration, values[i], timeout=20))
                              for i, s in enumerate(senders)]
                    sums = await agent.collect(iteration, timeout=20)
                    for got, exact in zip(sums, want, strict=True):
                        assert np.array_equal(got.astype(np.int64), exact)
                    await agent.send_results(iteration, sums, total=3)
                    for task in pushes:
                        back, total = await task
                        assert total == 3
                        for got, exact in zip(back, want, strict=True):
                            assert np.array_equal(got.astype(np.int64), exact)
                finally:
                    for s in senders:
                        s.close()
                    agent.close()
                    await serving
            stats = xdp.stats() if xdp is not None else dict(agent.fallback.counters)  # type: ignore[union-attr]
            return {"widened": [s.widened for s in senders],
                    "stats": {k: v - before.get(k, 0) for k, v in stats.items()}}
        finally:
            if xdp is not None:
                xdp.detach()


def test_integers_past_the_narrow_lane_go_wider_and_the_sum_stays_exact(mode: str,
                                                                       request: pytest.FixtureRequest) -> None:
    xdp = request.getfixturevalue("xdp_program") if mode == "xdp" else None
    out = asyncio.run(run_widening(mode, xdp))
    assert out["widened"] == [0, 1, 1]   # the overflow of int8 lanes, recovered and counted
    assert out["stats"]["overflow"] == 0 and out["stats"]["complete"] >= 4
