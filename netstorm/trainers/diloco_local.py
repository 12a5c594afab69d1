"""DiLoCo on real data with one node per DC on loopback: ``python -m netstorm.trainers.diloco_local``.

It starts a scheduler and one node per DC (``netstorm.local.LocalCluster``), one ``diloco_run`` trainer
process per DC, and folds their JSON lines into one result: per DC the held-out evaluations of the
global parameters, the syncs (seconds, contributors, weight, WAN bytes), the share of wall time in
inner steps, and whether every DC ended with the same digest. Loopback has no WAN: this measures the
algorithm and the integration on the data (loss, accuracy, identity), not the WAN's rates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from netstorm.local import LocalCluster
from netstorm.provenance import write_result


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m netstorm.trainers.diloco_local")
    parser.add_argument("--nodes", default="1,2,3")
    parser.add_argument("--scenario", default="scale-5")
    parser.add_argument("--out", required=True)
    parser.add_argument("--run-dir", default=None)
    return parser.parse_known_args(argv)


async def run(args: argparse.Namespace, trainer_args: list[str]) -> dict[str, Any]:
    nodes = [int(n) for n in args.nodes.split(",")]
    run_dir = Path(args.run_dir)
    cluster = LocalCluster(args.scenario, nodes, run_dir, scheduler_args=["--nodes", args.nodes],
                           common_args=["--iteration-timeout", "600"])
    outs = {dc: run_dir / f"trainer-{dc}.jsonl" for dc in nodes}
    started = time.time()
    logs = {dc: (run_dir / f"trainer-{dc}.log").open("wb") for dc in nodes}
    try:
        async with cluster:
            procs = [await asyncio.create_subprocess_exec(
                sys.executable, "-m", "netstorm.trainers.diloco_run", "--socket", str(cluster.socket_path(dc)),
                "--dc-index", str(i), "--dcs", str(len(nodes)), "--out", str(outs[dc]), *trainer_args,
                stderr=logs[dc]) for i, dc in enumerate(nodes)]
            codes = await asyncio.gather(*(p.wait() for p in procs))
    finally:
        for log in logs.values():
            log.close()
    if any(codes):
        raise SystemExit(f"trainers exited with {codes}; logs in {run_dir}")
    dcs: dict[str, Any] = {}
    for dc, path in outs.items():
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        start = next(x for x in lines if x["kind"] == "start")
        end = next(x for x in lines if x["kind"] == "end")
        syncs = [x for x in lines if x["kind"] == "sync"]
        dcs[str(dc)] = {
            "parameters": start["parameters"], "bytes": start["bytes"],
            "eval": [{k: x[k] for k in ("t_s", "step", "loss", "accuracy")} for x in lines if x["kind"] == "eval"],
            "sync_s": [round(x["seconds"], 4) for x in syncs],
            "contributors": sorted({tuple(x["contributors"]) for x in syncs}),
            "wan_bytes_per_sync": statistics.median(x["wan_bytes"] for x in syncs) if syncs else None,
            "compute_fraction": end["compute_fraction"], "wall_s": end["wall_s"], "digest": end["digest"],
        }
    digests = {d["digest"] for d in dcs.values()}
    return {"command": "python -m netstorm.trainers.diloco_local " + " ".join(sys.argv[1:]),
            "started": started, "trainer_args": trainer_args, "identical": len(digests) == 1, "dcs": dcs}


def main(argv: list[str] | None = None) -> int:
    args, trainer_args = parse(argv)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="diloco-", dir="/tmp"))
    run_dir.mkdir(parents=True, exist_ok=True)
    args.run_dir = str(run_dir)
    result = asyncio.run(run(args, trainer_args))
    write_result(args.out, result)
    first = next(iter(result["dcs"].values()))
    print(f"identical={result['identical']} parameters={first['parameters']} final eval={first['eval'][-1:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
