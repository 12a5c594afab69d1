"""``netstorm bench lan-rounds``: what a LAN worker sends per iteration, dense against FediAC's rounds.

One namespace LAN (a gateway and N workers on a bridge), one aggregation path (``--mode``), the same
model. Dense: every worker pushes the model as int32 fixed-point lanes, as an uncompressed job's LAN
worker does. FediAC: every worker runs ``CompressedEdgeWorker`` (the votes round, then the values up to
the GIA's size), and the gateway plans each round's wire and adds its own trainer's integers
(``GatewayRounds``), as a gateway role does, and returns each round's result in the form its wire names
(``Wire.back``: the GIA as a bitmap, the sums as the narrowest integers). Per iteration and worker, both
report the DATA datagrams and bytes sent (retransmissions included, 28 bytes of IPv4/UDP headers each)
and the RESULT bytes the gateway queued once (multicast: what each worker receives, IPv4/UDP headers
included), and the wall time per iteration. ``--gia-reuse N`` runs FediAC with ``fediac_gia_reuse``.
(The exactness of FediAC's integer sums is what ``tests/test_edge_fediac.py`` checks; this counts bytes.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import numpy as np

from netstorm.lan.header import HEADER_BYTES, IP_UDP_BYTES, Precision

HELP = "LAN bytes and time per iteration: dense fixed point against FediAC's integer rounds, one namespace LAN"
PORT = 9530
JOB = 4
GROUP = ("239.77.0.30", 9531)
SEED = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=4, help="LAN workers (default 4)")
    parser.add_argument("--elements", type=int, default=200_000, help="model size in float32 elements")
    parser.add_argument("--iterations", type=int, default=4, help="iterations per method (default 4)")
    parser.add_argument("--mode", choices=("xdp", "userspace"), default="xdp", help="aggregation path")
    parser.add_argument("--loss", type=float, default=0.0, help="fraction of first transmissions dropped")
    parser.add_argument("--k", type=float, default=0.05, help="fediac_k (default the paper's 5 %%)")
    parser.add_argument("--bits", type=int, default=8, help="fediac_bits (default 8: int8 value lanes)")
    parser.add_argument("--pool", type=int, default=1024, help="slot pool (edge_pool_slots)")
    parser.add_argument("--gia-reuse", type=int, default=1, help="fediac_gia_reuse (default 1: a vote every "
                        "iteration)")
    parser.add_argument("--out", metavar="FILE", default=None, help="also write the JSON, with the command, to FILE")


def run(args: argparse.Namespace) -> int:
    out = asyncio.run(measure(args))
    out["command"] = "netstorm bench lan-rounds " + " ".join(sys.argv[sys.argv.index("lan-rounds") + 1:]) \
        if "lan-rounds" in sys.argv else "netstorm bench lan-rounds"
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        from netstorm.provenance import write_result

        write_result(args.out, out)
    return 0


def _datagram_bytes(lanes: int, precision: Precision) -> int:
    return IP_UDP_BYTES + HEADER_BYTES + lanes * precision.lane_bytes


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from bpf.agent import EdgeAgent
    from netstorm.compression.options import CompressionOptions
    from netstorm.compression.session import Rounds
    from netstorm.emulation.bridge_lan import GATEWAY_IP, Lan
    from netstorm.emulation.netns import run_in
    from netstorm.lan.compressed import CompressedEdgeWorker
    from netstorm.lan.header import lanes_for_mtu
    from netstorm.lan.introunds import GatewayRounds, RoundPlan, layout_order
    from netstorm.lan.layout import EdgeLayout
    from netstorm.lan.sender import EdgeSender

    options = CompressionOptions("fediac", k=args.k, bits=args.bits, gia_reuse=args.gia_reuse)
    lanes = lanes_for_mtu(1500)
    model = {"w": np.zeros(args.elements, np.float32)}
    registered = Rounds(options, model).registered(model)
    names = list(layout_order(registered))
    full = EdgeLayout.uniform([registered[n].size for n in names], scale=16, lanes=lanes, pool=args.pool)
    dense_layout = EdgeLayout.uniform([args.elements], scale=16, lanes=lanes, pool=args.pool)
    rng = np.random.default_rng(SEED)
    host = {"kernel": os.uname().release, "cpus": os.cpu_count(), "load_average_before": os.getloadavg()}
    out: dict[str, Any] = {"workers": args.workers, "elements": args.elements, "iterations": args.iterations,
                           "mode": args.mode, "loss": args.loss, "fediac_k": args.k, "fediac_bits": args.bits,
                           "fediac_gia_reuse": args.gia_reuse,
                           "lanes": lanes, "pool": args.pool}
    with Lan(args.workers) as lan:
        xdp = None
        if args.mode == "xdp":
            from bpf.xdp import XdpAggregator

            xdp = XdpAggregator(full, job=JOB, port=PORT, expected=(1 << args.workers) - 1, timeout=0.1)
            ifindex = lan.gateway_ifindex()
            out["attached"] = run_in(lan.gateway, lambda: xdp.attach(ifindex))
        try:
            agent = EdgeAgent(lan.udp_socket(lan.gateway, GATEWAY_IP, PORT), full, workers=args.workers, job=JOB,
                              mode=args.mode, xdp=xdp, slot_timeout=0.1, group=GROUP, retransmit=0.05)
            senders = [EdgeSender(lan.udp_socket(ns, lan.worker_ip(i)), (GATEWAY_IP, PORT), worker=i,
                                  layout=EdgeLayout.uniform([1], scale=0, lanes=lanes), job=JOB, loss=args.loss,
                                  seed=SEED, group_opener=lan.group_opener(ns)) for i, ns in enumerate(lan.workers)]
            clients = [CompressedEdgeWorker(s, options, contributor=1 + i, seed=SEED, applied=0, timeout=60.0)
                       for i, s in enumerate(senders)]
            contributors = args.workers + 1
            trainer = Rounds(options, model, SEED)
            trainer.registered(model)
            trainer.start(contributors, 0)
            plan = RoundPlan(registered, options, lanes=lanes, pool=full.num_slots, scale=16,
                             contributors=contributors)
            async with asyncio.TaskGroup() as tg:
                serving = tg.create_task(agent.run())
                try:
                    inits = [tg.create_task(c.init(model)) for c in clients]
                    await agent.wait_workers(timeout=20)
                    iteration = 1000
                    gateway = GatewayRounds(plan, iteration + 1)
                    wire = gateway.wire_of(iteration + 1)
                    agent.plan(iteration + 1, wire.layout, integer=wire.integer, back=wire.back)
                    await agent.send_results(iteration, [np.zeros(s, np.float32) for s in full.sizes],
                                             total=contributors, unicast=True)
                    for task in inits:
                        await task
                    iteration += 1
                    # FediAC: the workers' rounds, the gateway trainer's integers added, checked against numpy
                    sent0 = [s.batch.datagrams for s in senders]
                    bytes_up = 0
                    bytes_down = 0
                    gias = []
                    rounds = []
                    started = time.perf_counter()
                    for _ in range(args.iterations):
                        grads = [{"w": rng.standard_normal(args.elements).astype(np.float32)}
                                 for _ in range(contributors)]
                        pushes = [tg.create_task(c.push_pull(grads[1 + i])) for i, c in enumerate(clients)]
                        steps = trainer.iteration(grads[0])
                        mine = next(steps)
                        while True:
                            wire = gateway.wire_of(iteration)
                            before = [s.batch.datagrams for s in senders]
                            down = agent.outbox.bulk_queued
                            lan_full = gateway.contribution(iteration, await agent.collect(iteration, timeout=60))
                            # every worker's datagrams of this round went out before its sum completed
                            bytes_up += sum(s.batch.datagrams - b for s, b in zip(senders, before, strict=True)) \
                                * _datagram_bytes(lanes, wire.precision)
                            dc = [lan_full[t].astype(np.float64) + np.asarray(mine[n], np.float64).reshape(-1)
                                  for t, n in enumerate(names)]
                            back, following = gateway.released(iteration, [d.astype(np.float32) for d in dc])
                            agent.plan(iteration + 1, following.layout, integer=following.integer,
                                       back=following.back)
                            down_bytes = agent.outbox.bulk_bytes_queued
                            await agent.send_results(iteration, back, total=contributors)
                            bytes_down += agent.outbox.bulk_bytes_queued - down_bytes + \
                                (agent.outbox.bulk_queued - down) * IP_UDP_BYTES
                            iteration += 1
                            shaped = plan.shaped([d.astype(np.float32) for d in dc], registered)
                            try:
                                mine = steps.send(shaped)
                            except StopIteration:
                                break
                        for task in pushes:
                            await task
                        gias.append(trainer.last.gia)
                        rounds.append(trainer.last.round_trips)
                    fediac_s = time.perf_counter() - started
                    fediac_datagrams = sum(s.batch.datagrams - b for s, b in zip(senders, sent0, strict=True))
                    fediac_pulls = sum(s.pulls for s in senders)
                    # dense: the model as int32 fixed point, every worker, same LAN and aggregator
                    dense = EdgeLayout.uniform([args.elements], scale=16, lanes=lanes, pool=full.num_slots)
                    for s in senders:
                        s.layout = dense
                        s.precision = Precision.FIXED32
                    sent0 = [s.batch.datagrams for s in senders]
                    down_dense = 0
                    started = time.perf_counter()
                    for _ in range(args.iterations):
                        agent.plan(iteration, dense)
                        values = [rng.standard_normal(args.elements).astype(np.float32) for _ in senders]
                        pushes2 = [tg.create_task(s.push_pull(iteration, [v], timeout=60))
                                   for s, v in zip(senders, values, strict=True)]
                        sums = await agent.collect(iteration, timeout=60)
                        down = agent.outbox.bulk_queued
                        down_bytes = agent.outbox.bulk_bytes_queued
                        await agent.send_results(iteration, sums, total=args.workers)
                        down_dense += agent.outbox.bulk_bytes_queued - down_bytes + \
                            (agent.outbox.bulk_queued - down) * IP_UDP_BYTES
                        for task2 in pushes2:
                            await task2
                        iteration += 1
                    dense_s = time.perf_counter() - started
                    dense_datagrams = sum(s.batch.datagrams - b for s, b in zip(senders, sent0, strict=True))
                finally:
                    for s in senders:
                        s.close()
                    agent.close()
                    await serving
        finally:
            if xdp is not None:
                xdp.detach()
                xdp.close()
    per = args.iterations * args.workers
    out["dense"] = {"datagrams_per_worker_iteration": dense_datagrams / per,
                    "bytes_per_worker_iteration": dense_datagrams * _datagram_bytes(lanes, Precision.FIXED32) / per,
                    "result_bytes_per_iteration": down_dense / args.iterations,
                    "iteration_s": dense_s / args.iterations, "chunks_per_worker": dense_layout.num_chunks}
    out["fediac"] = {"datagrams_per_worker_iteration": fediac_datagrams / per,
                     "bytes_per_worker_iteration": bytes_up / per,
                     "result_bytes_per_iteration": bytes_down / args.iterations,
                     "iteration_s": fediac_s / args.iterations, "gia": gias, "round_trips": rounds,
                     "pulls_per_worker_iteration": fediac_pulls / per}
    out["fediac_over_dense_bytes"] = out["fediac"]["bytes_per_worker_iteration"] / \
        out["dense"]["bytes_per_worker_iteration"]
    out["fediac_over_dense_result_bytes"] = out["fediac"]["result_bytes_per_iteration"] / \
        out["dense"]["result_bytes_per_iteration"]
    out["host"] = {**host, "load_average_after": os.getloadavg(),
                   "note": "2-core VM shared with other jobs"}
    return out
