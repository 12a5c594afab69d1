"""``netstorm bench loopback``: how fast and how cheaply a local cluster synchronizes a model.

A ``netstorm local`` cluster of ``--nodes`` DCs on loopback, one synthetic trainer per DC (no compute
time, so every second is synchronization), ``--iterations`` iterations of a ``--model-mb`` float32
model. Reported against baselines measured in the same run:

- synchronization throughput (model bytes per second of push_pull time, slowest DC, iterations after
  the first) against this machine's
  memory-copy bandwidth (a numpy copy of the same number of bytes): loopback has no WAN, so copying
  memory is the physical ceiling the runtime's per-byte work is compared with;
- CPU seconds per node per iteration and per synchronized MB (utime + stime of every node process,
  read from /proc between the end of the first iteration and the end of the last, so registration
  and warm-up are excluded) against the target of 1 CPU-second per node per iteration for 100 MB.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from netstorm import config
from netstorm.trainers.launch import LaunchError, Trainers, descendants, local_cluster

HELP = "sync throughput and CPU per node of a loopback cluster, vs memory-copy bandwidth and the CPU target"

TARGET_CPU_S_PER_100MB = 1.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=9, help="DCs in the cluster (default 9)")
    parser.add_argument("--model-mb", type=float, default=100.0, help="float32 model size in MB (default 100)")
    parser.add_argument("--iterations", type=int, default=3, help="iterations, at least 2 (default 3)")
    parser.add_argument("--run-dir", default=None, help="sockets and logs (default: a new temporary directory)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for any one step")
    parser.add_argument("--out", dest="json", default=None, metavar="FILE",
                        help="also write the results as JSON to FILE")
    parser.add_argument("--json", dest="json", help=argparse.SUPPRESS)  # the former name of --out
    parser.add_argument("--tls-cost", action="store_true",
                        help="compare no secret, a job secret, and a secret with wan_tls, one right after the other "
                             "(a fresh secret and certificate in a temporary directory)")
    parser.add_argument("--rounds", type=int, default=3, help="with --tls-cost: rounds of the three (default 3)")
    config.add_arguments(parser)


def config_flags(args: argparse.Namespace) -> list[str]:
    """The config flags given on this command line, to pass on to ``netstorm local``."""
    flags = ["--config", args.config] if getattr(args, "config", None) else []
    for name in config.FIELDS:
        value = getattr(args, f"opt_{name}", None)
        if value is not None:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


def memcpy_bandwidth(nbytes: int, *, repeats: int = 5) -> float:
    """Bytes per second of the best of ``repeats`` numpy copies of ``nbytes`` (pages touched first)."""
    src = np.ones(max(1, nbytes // 4), dtype=np.float32)
    dst = np.zeros_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return src.nbytes / best


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads) from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # After the command name: state is field 3 (index 0 here); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def host_cpu() -> tuple[int, int]:
    """(busy, total) CPU clock ticks of the whole host since boot, from /proc/stat's first line."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields)
    return total - idle, total


def node_processes(local_pid: int) -> dict[int, int]:
    """node id -> pid of each ``netstorm node`` below the ``netstorm local`` process."""
    nodes: dict[int, int] = {}
    for pid in descendants(local_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "node" in argv and "--id" in argv:
            nodes[int(argv[argv.index("--id") + 1])] = pid
    return nodes


def _sample(pids: dict[int, int]) -> dict[int, float]:
    return {key: cpu_seconds(pid) for key, pid in pids.items()}


@dataclasses.dataclass(frozen=True)
class Mark:
    """Node and host CPU times when every DC had finished one iteration."""

    t: float
    nodes: dict[int, float]
    host: tuple[int, int]


def run(args: argparse.Namespace) -> int:
    if args.iterations < 2:
        raise LaunchError("--iterations must be at least 2: CPU is measured from the first iteration's end")
    if getattr(args, "tls_cost", False):
        return run_tls_cost(args)
    result = measure(args, config_flags(args))
    if args.json:
        from netstorm.provenance import write_result

        write_result(args.json, result, indent=2)
    return 0 if result["exact"] else 1


TLS_SETTINGS = ("plain", "secret", "secret+tls")
"""What ``--tls-cost`` compares: no secret, the membership handshake only, the handshake inside TLS."""


def run_tls_cost(args: argparse.Namespace) -> int:
    """The cost of ``wan_tls``: the same cluster without a secret, with one, and with TLS, one right after
    the other, ``--rounds`` times (so a neighbour's load falls on all three alike)."""
    from netstorm.commands.secret import SECRET_BYTES, write_certificate

    keys = Path(tempfile.mkdtemp(prefix="netstorm-tls-cost-"))
    secret = keys / "job.secret"
    secret.write_bytes(os.urandom(SECRET_BYTES))
    secret.chmod(0o600)
    write_certificate(secret, force=True)
    base = config_flags(args)
    flags = {"plain": base, "secret": [*base, "--secret-file", str(secret)],
             "secret+tls": [*base, "--secret-file", str(secret), "--wan-tls", "true"]}
    runs: list[dict[str, Any]] = []
    try:
        for round_ in range(args.rounds):
            for setting in TLS_SETTINGS:
                print(f"--- round {round_ + 1} of {args.rounds}: {setting}")
                runs.append({"round": round_ + 1, "setting": setting, **measure(args, flags[setting])})
    finally:
        shutil.rmtree(keys, ignore_errors=True)  # the run's throwaway secret and key
    summary = {}
    for setting in TLS_SETTINGS:
        mine = [r for r in runs if r["setting"] == setting]
        summary[setting] = {
            "node_cpu_s_per_mb_median": statistics.median(r["node_cpu_s_per_mb"] for r in mine),
            "sync_bytes_per_s_median": statistics.median(r["sync_bytes_per_s"] for r in mine),
            "host_cpu_busy_max": max(r["host_cpu_busy"] for r in mine)}
    plain = summary["plain"]
    for row in summary.values():
        row["cpu_vs_plain"] = _ratio(row["node_cpu_s_per_mb_median"], plain["node_cpu_s_per_mb_median"])
        row["throughput_vs_plain"] = _ratio(row["sync_bytes_per_s_median"], plain["sync_bytes_per_s_median"])
    print("node CPU per MB (median), and against no secret (- : too short a run to resolve):")
    for setting, row in summary.items():
        print(f"  {setting:<11} {row['node_cpu_s_per_mb_median'] * 1e3:6.2f} ms per MB  "
              f"{_times(row['cpu_vs_plain'])}   throughput {_times(row['throughput_vs_plain'])}")
    exact = all(r["exact"] for r in runs)
    if args.json:
        from netstorm.provenance import write_result

        write_result(args.json, {"settings": list(TLS_SETTINGS), "rounds": args.rounds, "summary": summary,
                                 "exact": exact, "runs": runs}, indent=2)
    return 0 if exact else 1


def _ratio(value: float, base: float) -> float | None:
    return value / base if base > 0 else None


def _times(ratio: float | None) -> str:
    return f"{ratio:5.2f} x" if ratio is not None else "    - x"


def measure(args: argparse.Namespace, flags: list[str]) -> dict[str, Any]:
    """One cluster's run: start it with ``flags``, run the trainers, report."""
    params = max(1, round(args.model_mb * 1e6 / 4))
    model_bytes = params * 4
    print(f"loopback bench: {args.nodes} nodes, model {model_bytes / 1e6:.1f} MB ({params} float32), "
          f"{args.iterations} iterations, {os.cpu_count()} CPUs")
    copy_bw = memcpy_bandwidth(model_bytes)
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="netstorm-loopback-"))
    with local_cluster(args.nodes, run_dir, flags=flags, ready_timeout=args.timeout) as cluster:
        nodes = node_processes(cluster.process.pid)
        if sorted(nodes) != cluster.node_ids:
            raise LaunchError(f"found node processes {sorted(nodes)} below netstorm local, "
                              f"expected {cluster.node_ids}")
        argvs = [[sys.executable, "-m", "netstorm.trainers.synthetic", "--socket", cluster.socket(node),
                  "--model", str(params), "--iterations", str(args.iterations),
                  "--timeout", str(args.timeout)] for node in cluster.node_ids]
        records: list[list[dict[str, Any]]] = [[] for _ in argvs]
        with Trainers(argvs, run_dir) as trainers:
            marks: dict[int, Mark] = {}
            done = 0
            while done < len(argvs):
                line = trainers.next_line(timeout=args.timeout)
                if line.record is None:
                    done += 1
                    if line.returncode != 0:
                        raise LaunchError(f"trainer of DC {cluster.node_ids[line.index]} exited with "
                                          f"{line.returncode}:\n{trainers.log_tail(line.index)}")
                    continue
                records[line.index].append(line.record)
                k = line.record.get("iteration")
                if k in (0, args.iterations - 1) and all(
                        any(r.get("iteration") == k for r in rs) for rs in records):
                    marks[k] = Mark(time.perf_counter(), _sample(nodes), host_cpu())
    # Measured again once the cluster is gone: on a shared host the best of both is the machine's.
    copy_bw = max(copy_bw, memcpy_bandwidth(model_bytes))
    result = summarize(args, model_bytes, copy_bw, records, marks)
    print_result(result)
    return result


def summarize(args: argparse.Namespace, model_bytes: int, copy_bw: float, records: list[list[dict[str, Any]]],
              marks: dict[int, Mark]) -> dict[str, Any]:
    """The numbers the benchmark reports, from the trainers' records and the two CPU samples."""
    last = args.iterations - 1
    first, end = marks[0], marks[last]
    measured = last  # iterations 1..last lie between the two samples
    def slowest(field: str, k: int) -> float:
        return max(float(r[field]) for rs in records for r in rs if r.get("iteration") == k)

    iteration_s = [slowest("seconds", k) for k in range(args.iterations)]
    sync_s = [slowest("sync_s", k) for k in range(args.iterations)]
    sync_steady = statistics.fmean(sync_s[1:])
    window = end.t - first.t
    steady_s = window / measured
    node_cpu = {node: (end.nodes[node] - first.nodes[node]) / measured for node in end.nodes}
    # Trainers report their own CPU time (they may have exited by the time the last line is read).
    trainer_cpu = [(rs[last]["cpu_s"] - rs[0]["cpu_s"]) / measured for rs in records]
    host_busy = (end.host[0] - first.host[0]) / max(end.host[1] - first.host[1], 1)
    cpus = os.cpu_count() or 1
    cluster_share = (sum(node_cpu.values()) + sum(trainer_cpu)) * measured / (window * cpus)
    # /proc counts CPU time in clock ticks: each process's and each CPU's figure may be off by a tick at
    # either end, which on a short window is a visible share
    tick = 1 / os.sysconf("SC_CLK_TCK")
    share_resolution = 2 * tick * (len(node_cpu) + len(trainer_cpu) + cpus) / (window * cpus)
    mb = model_bytes / 1e6
    target = TARGET_CPU_S_PER_100MB * mb / 100
    return {
        "nodes": args.nodes, "model_bytes": model_bytes, "iterations": args.iterations,
        "exact": all(r.get("exact") is True for rs in records for r in rs) and all(len(rs) == args.iterations
                                                                                   for rs in records),
        "iteration_s": iteration_s,
        "sync_s": sync_s,
        "steady_iteration_s": steady_s,
        "sync_bytes_per_s": model_bytes / sync_steady,
        "memcpy_bytes_per_s": copy_bw,
        "sync_vs_memcpy": model_bytes / sync_steady / copy_bw,
        "node_cpu_s_per_iteration": node_cpu,
        "node_cpu_s_per_iteration_mean": statistics.fmean(node_cpu.values()),
        "node_cpu_s_per_iteration_max": max(node_cpu.values()),
        "node_cpu_s_per_mb": statistics.fmean(node_cpu.values()) / mb,
        "trainer_cpu_s_per_iteration_mean": statistics.fmean(trainer_cpu),
        "target_node_cpu_s_per_iteration": target,
        "node_cpu_vs_target": max(node_cpu.values()) / target,
        "cpus": cpus,
        "host_cpu_busy": host_busy,
        "cluster_cpu_share": cluster_share,
        "cpu_share_resolution": share_resolution,
    }


def print_result(r: dict[str, Any]) -> None:
    mb = r["model_bytes"] / 1e6
    print(f"push_pull times (s, slowest DC): {', '.join(f'{s:.3f}' for s in r['sync_s'])}; iteration period "
          f"after the first: {r['steady_iteration_s']:.3f} s (includes the trainers' gradient fill and check)")
    print(f"sync throughput  {r['sync_bytes_per_s'] / 1e6:10.1f} MB/s of model   "
          f"= {r['sync_vs_memcpy']:.4f} x memory-copy bandwidth ({r['memcpy_bytes_per_s'] / 1e9:.2f} GB/s)")
    print(f"node CPU         {r['node_cpu_s_per_iteration_mean']:10.3f} s per node per iteration (max "
          f"{r['node_cpu_s_per_iteration_max']:.3f}) = {r['node_cpu_s_per_mb'] * 1e3:.2f} ms per MB")
    print(f"target           {r['target_node_cpu_s_per_iteration']:10.3f} s per node per iteration for {mb:.1f} MB "
          f"(1 s per 100 MB): max node at {r['node_cpu_vs_target']:.2f} x target "
          f"({'within' if r['node_cpu_vs_target'] <= 1 else 'OVER'})")
    print(f"trainer CPU      {r['trainer_cpu_s_per_iteration_mean']:10.3f} s per iteration (gradient fill + "
          f"exact check, not the runtime's)")
    print(f"host CPU         {r['host_cpu_busy']:10.0%} busy during the measured iterations, "
          f"this cluster's nodes and trainers {r['cluster_cpu_share']:.0%} of its {r['cpus']} CPUs "
          f"(either share +/- {r['cpu_share_resolution']:.1%}: /proc's tick resolution over this window)")
    print(f"results exact:   {r['exact']}")
    if r["host_cpu_busy"] > 0.9:
        print("note: the host was CPU-bound: iteration times and throughput measure CPU contention, not the "
              "runtime; CPU seconds per node and per MB are the portable figures")
