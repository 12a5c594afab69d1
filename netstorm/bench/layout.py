"""``netstorm bench layout``: how long a model of many tensors takes to register.

Three measurements, each at every ``--tensors`` count (default 1k, 20k and 100k tensors of ``--elements``
float32 elements each):

- ``build``: ``Layout.build`` of that many specs (what every node and trainer does at ``init``);
- ``trainer``: the trainer side of ``init`` and of one push and pull (``netstorm.client.Registry``: the
  layout, the shared-memory copy in, the results copied out);
- with ``--cluster N``: a ``netstorm local`` cluster of 3 DCs (internet2-9's DCs 1, 2, 3) where every DC's
  trainer registers N tensors and runs one ``push_pull``, timed from the first ``init`` to the last result,
  with the sum checked exactly against numpy and the scheduler asked whether every DC is still alive.

Times are wall-clock and CPU seconds, the best and the median of ``--repeats`` runs; the cluster's row adds every
process's CPU seconds (trainers, scheduler, nodes) and the host's load average, since on a shared host the
wall-clock figure says more about the neighbours than about the code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from netstorm.provenance import write_result

HELP = "layout building and init of 1k, 20k, 100k tensors (and a 3-DC local cluster's init + push_pull)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensors", default="1000,20000,100000", metavar="N,N,...",
                        help="tensor counts (default 1000,20000,100000)")
    parser.add_argument("--elements", type=int, default=4, help="float32 elements per tensor (default 4)")
    parser.add_argument("--chunk-size", type=int, default=65536, help="the layout's chunk size (default 65536)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per measurement (default 5)")
    parser.add_argument("--cluster", type=int, default=0, metavar="N",
                        help="also time init + one push_pull of N tensors on a 3-DC local cluster (0: no)")
    parser.add_argument("--out", metavar="FILE", default=None, help="write the result JSON here")


def _model(count: int, elements: int, dc: int) -> dict[str, np.ndarray]:
    return {f"layer{i:06d}.bias": np.full(elements, dc * (i % 7), np.float32) for i in range(count)}


def _timed(repeats: int, work: Any) -> dict[str, float]:
    times, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        work()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"best_s": min(times), "median_s": statistics.median(times), "cpu_best_s": min(cpu),
            "cpu_median_s": statistics.median(cpu)}


def _build_row(count: int, elements: int, chunk_size: int, repeats: int) -> dict[str, Any]:
    from netstorm.layout import Layout, TensorSpec

    specs = [TensorSpec(f"layer{i:06d}.bias", (elements,), "float32") for i in range(count)]
    layout = Layout.build(specs, chunk_size)
    return {"tensors": count, "chunks": len(layout.chunks),
            **_timed(repeats, lambda: Layout.build(specs, chunk_size))}


def _trainer_row(count: int, elements: int, repeats: int) -> dict[str, Any]:
    from netstorm.client import Registry, release_init

    model = _model(count, elements, 1)
    registry = Registry(inline=False)
    paths: list[str] = []

    def init() -> None:
        paths.append(registry.prepare_init(model)[2])

    row: dict[str, Any] = {"tensors": count, "init": _timed(repeats, init)}
    for path in paths:
        release_init(path)
    row["push"] = _timed(repeats, lambda: registry.prepare_push(model))
    row["pull"] = _timed(repeats, lambda: registry.results(list(model), b""))
    registry.close()
    return row


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _cluster_row(count: int, elements: int) -> dict[str, Any]:
    import netstorm
    from netstorm.local import LocalCluster
    from scheduler import admin

    nodes = [1, 2, 3]
    models = {dc: _model(count, elements, dc) for dc in nodes}
    with tempfile.TemporaryDirectory(prefix="ns-layout-") as tmp:
        cluster = LocalCluster("internet2-9", nodes, Path(tmp), scheduler_args=["--nodes", "1,2,3"],
                               common_args=["--iteration-timeout", "120"])
        async with cluster:
            assert cluster.scheduler_address is not None
            clients = {dc: await netstorm.aconnect(cluster.socket_path(dc), timeout=300) for dc in nodes}
            cpu_before = time.process_time()
            start = time.perf_counter()
            await asyncio.gather(*(kv.init(models[dc]) for dc, kv in clients.items()))
            inited = time.perf_counter()
            results = await asyncio.gather(*(kv.push_pull(models[dc]) for dc, kv in clients.items()))
            done = time.perf_counter()
            exact = all(np.array_equal(got[name], sum(models[dc][name] for dc in nodes))
                        for got in results for name in models[1])
            status = await admin.status(cluster.scheduler_address, timeout=30)
            cpu = {child.name: round(_cpu_seconds(child.process.pid), 2) for child in cluster.children}
            for kv in clients.values():
                await kv.close()
    return {"tensors": count, "dcs": len(nodes), "init_s": inited - start, "push_pull_s": done - inited,
            "total_s": done - start, "exact": exact, "alive": sorted(status.alive), "dead": [],
            "cpu_s": {"trainers": round(time.process_time() - cpu_before, 2), **cpu},
            "load_average": list(os.getloadavg())}


def run(args: argparse.Namespace) -> int:
    counts = [int(n) for n in args.tensors.split(",") if n]
    result: dict[str, Any] = {"benchmark": "layout", "elements_per_tensor": args.elements,
                              "chunk_size": args.chunk_size, "repeats": args.repeats, "cpus": os.cpu_count(),
                              "build": [], "trainer": []}
    for count in counts:
        row = _build_row(count, args.elements, args.chunk_size, args.repeats)
        result["build"].append(row)
        print(f"build    {count:>7} tensors: best {row['best_s']:.3f} s, median {row['median_s']:.3f} s "
              f"(CPU best {row['cpu_best_s']:.3f} s)", flush=True)
    for count in counts:
        row = _trainer_row(count, args.elements, args.repeats)
        result["trainer"].append(row)
        print(f"trainer  {count:>7} tensors: init {row['init']['best_s']:.3f} s, push {row['push']['best_s']:.3f} s, "
              f"pull {row['pull']['best_s']:.3f} s (best)", flush=True)
    if args.cluster:
        row = asyncio.run(_cluster_row(args.cluster, args.elements))
        row["dead"] = [dc for dc in (1, 2, 3) if dc not in row["alive"]]
        result["cluster"] = row
        print(f"cluster  {args.cluster:>7} tensors, 3 DCs: init {row['init_s']:.1f} s + push_pull "
              f"{row['push_pull_s']:.1f} s, exact {row['exact']}, dead {row['dead']}, cpu {row['cpu_s']}, "
              f"load {row['load_average'][0]:.1f}", flush=True)
    if args.out:
        write_result(args.out, result)
    else:
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
    return 0 if not args.cluster or (result["cluster"]["exact"] and not result["cluster"]["dead"]) else 1
