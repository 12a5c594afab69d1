"""The edge benchmark's gloo path: torch.distributed gloo all_reduce among the LAN's workers, the peer a DC
would otherwise run, on the same veth LAN, on the same inputs.

One process per worker namespace (``python -m netstorm.bench.gloo_lan``), gloo bound to the worker's LAN
address, rank 0 serving the rendezvous store. Each rank draws its inputs for every iteration before it
says ``ready``; on ``go`` (its stdin) the ranks pass a barrier, all-reduce one flat float32 tensor per
iteration in place, and print the window they measured (``t0``, ``t1`` on the shared monotonic clock, and
their own CPU over it); only then does each check every result against the int64 reference, outside the
window. The driver (``run_gloo``) adds the kernel's softirq threads and itself from just before ``go`` to
the last rank's window line (``hostcpu.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import select
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from netstorm.bench.edge_inputs import contribution, reference

STORE_PORT = 29610
READY_TIMEOUT_S = 120.0


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rank_main(args: argparse.Namespace, out: IO[str]) -> int:
    import torch
    import torch.distributed as dist

    gloo: Any = dist.ProcessGroupGloo  # private options API, as gloo_trainer uses it
    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore(args.store_host, args.store_port, args.world, args.rank == 0, timeout=timeout)
    options = gloo._Options()
    options._devices = [gloo.create_device(hostname=args.address)]
    options._timeout = timeout
    group = gloo(store, args.rank, args.world, options)
    inputs = [contribution(args.seed, k, args.rank, args.elements, args.scale, args.world)
              for k in range(args.iterations)]
    tensors = [torch.from_numpy(x) for x in inputs]
    group.allreduce([torch.zeros(1024)]).wait()  # every pair connected before the window
    out.write("ready\n")
    out.flush()
    if sys.stdin.readline().strip() != "go":
        return 2
    group.barrier().wait()
    cpu0, t0 = _cpu_seconds(), time.monotonic()
    for t in tensors:
        group.allreduce([t]).wait()
    t1, cpu1 = time.monotonic(), _cpu_seconds()
    out.write(json.dumps({"rank": args.rank, "t0": t0, "t1": t1, "cpu": cpu1 - cpu0}) + "\n")
    out.flush()
    exact = all(np.array_equal(inputs[k], reference(args.seed, k, args.world, args.elements, args.scale))
                for k in range(args.iterations))
    out.write(json.dumps({"rank": args.rank, "exact": exact}) + "\n")
    out.flush()
    group.barrier().wait()  # leave together
    return 0


def _readline(proc: subprocess.Popen[bytes], deadline: float, who: str) -> str:
    assert proc.stdout is not None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"gloo {who} said nothing before its deadline")
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"gloo {who} exited with {proc.wait()} (see its log)")
            return line.decode().strip()


def run_gloo(lan: Any, *, elements: int, iterations: int, scale: int, seed: int, log_dir: Path,
             timeout: float = 600.0) -> dict[str, Any]:
    """All-reduce every iteration among ``lan``'s workers with gloo; timings, host CPU and exactness."""
    from netstorm.bench.hostcpu import HostCpu
    from netstorm.emulation import netns

    world = len(lan.workers)
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for r, ns in enumerate(lan.workers):
            log = (log_dir / f"gloo-rank{r}.log").open("wb")
            logs.append(log)
            procs.append(netns.spawn(ns, [
                sys.executable, "-m", "netstorm.bench.gloo_lan", "--rank", str(r), "--world", str(world),
                "--store", f"{lan.worker_ip(0)}:{STORE_PORT}", "--address", lan.worker_ip(r),
                "--elements", str(elements), "--iterations", str(iterations), "--scale", str(scale),
                "--seed", str(seed), "--timeout", str(timeout)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log))
        deadline = time.monotonic() + READY_TIMEOUT_S + elements * iterations * 1e-7
        for r, p in enumerate(procs):
            line = _readline(p, deadline, f"rank {r}")
            if line != "ready":
                raise RuntimeError(f"gloo rank {r} said {line!r} instead of ready")
        cpu = HostCpu()
        cpu.start()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(b"go\n")
            p.stdin.flush()
        deadline = time.monotonic() + timeout
        windows = [json.loads(_readline(p, deadline, f"rank {r}")) for r, p in enumerate(procs)]
        window = cpu.stop(extra=sum(w["cpu"] for w in windows))
        checks = [json.loads(_readline(p, deadline + timeout, f"rank {r}")) for r, p in enumerate(procs)]
        for r, p in enumerate(procs):
            if p.wait(timeout=60) != 0:
                raise RuntimeError(f"gloo rank {r} exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    wall = max(w["t1"] for w in windows) - min(w["t0"] for w in windows)
    return {"wall_seconds": wall, "host_cpu": window, "ranks_cpu_seconds": sum(w["cpu"] for w in windows),
            "exact": all(c["exact"] for c in checks)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m netstorm.bench.gloo_lan", description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--store", required=True, help="HOST:PORT of the rendezvous store (rank 0 serves it)")
    parser.add_argument("--address", required=True, help="address gloo's connections bind to")
    parser.add_argument("--elements", type=int, required=True)
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--scale", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    host, _, port = args.store.rpartition(":")
    args.store_host, args.store_port = host, int(port)
    return rank_main(args, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
