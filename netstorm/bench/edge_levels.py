"""The edge benchmark's LAN options: two levels (which workers aggregate whom, their aggregator
processes), mixed precisions (what each worker sends, and the exact sum that must come back).

Two levels: workers ``0..K-1`` aggregate, and the others are dealt to them in turn (worker ``j >= K``
to aggregator ``(j - K) % K``), so clusters differ by at most one member. Precisions cycle through the
list given (``fp32,fp16`` makes even workers fp32 and odd ones fp16); the exact sum is the int64 sum of
each worker's values as its precision represents them (``netstorm.lan.precision.worker_values``),
quantised at the layout's scale, which is what both aggregation paths must return.
"""

from __future__ import annotations

import argparse
import json
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

PRECISION_NAMES = ("fp32", "fp16", "bf16", "int8")
READY_TIMEOUT_S = 120.0


def parse_precisions(text: str, workers: int) -> list[str]:
    """One precision per worker, cycling through the comma-separated ``text``."""
    from netstorm.errors import NetStormError

    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in PRECISION_NAMES]
    if bad or not names:
        raise NetStormError(f"--precision takes {', '.join(PRECISION_NAMES)} (comma-separated); got {text!r}")
    return [names[i % len(names)] for i in range(workers)]


def wire_precision(name: str) -> Any:
    from netstorm.lan.header import Precision

    return {"fp32": Precision.FIXED32, "fp16": Precision.FP16, "bf16": Precision.BF16,
            "int8": Precision.INT8}[name]


def topology(workers: int, levels: int, aggregators: int) -> Any:
    """The LanTopology of ``levels`` (1: none; 2: ``aggregators`` clusters, members dealt in turn)."""
    from netstorm.errors import NetStormError
    from netstorm.lan.deploy import LanTopology

    if levels == 1:
        return LanTopology(workers)
    if levels != 2:
        raise NetStormError(f"--levels is 1 or 2, got {levels}")
    if not 1 <= aggregators < workers:
        raise NetStormError(f"--aggregators must be in 1..{workers - 1} for {workers} workers, got {aggregators}")
    clusters: dict[int, list[int]] = {a: [] for a in range(aggregators)}
    for j in range(aggregators, workers):
        clusters[(j - aggregators) % aggregators].append(j)
    return LanTopology(workers, {a: tuple(m) for a, m in clusters.items()})


def mixed_reference(parts: list[np.ndarray], precisions: list[str], lanes: int, scale: int) -> np.ndarray:
    """The exact LAN sum of ``parts`` (one flat float32 tensor per worker) sent at ``precisions``."""
    from netstorm.lan.precision import worker_values

    total = np.zeros(parts[0].size, np.int64)
    for values, name in zip(parts, precisions, strict=True):
        total += np.rint(worker_values(values, wire_precision(name), lanes) * 2.0**scale).astype(np.int64)
    return (total.astype(np.float64) * 2.0**-scale).astype(np.float32)


class Aggregators:
    """The cluster aggregators of a two-level LAN, one process each in its worker's namespace."""

    def __init__(self, lan: Any, topo: Any, *, gateway: tuple[str, int], job: int, mode: str,
                 secret_file: str | None, log_dir: Path) -> None:
        self.lan = lan
        self.heads = sorted(topo.clusters)
        self.gateway = gateway
        self.job = job
        self.mode = mode
        self.secret_file = secret_file
        self.log_dir = log_dir
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.ready: dict[int, dict[str, Any]] = {}
        self.final: dict[int, dict[str, Any]] = {}

    def spawn(self) -> None:
        from netstorm.emulation import netns

        for w in self.heads:
            log = (self.log_dir / f"aggregator-{w}.log").open("wb")
            secret = ["--secret-file", self.secret_file] if self.secret_file else []
            self.procs[w] = netns.spawn(self.lan.workers[w], [
                sys.executable, "-m", "netstorm.bench.edge_aggregator", "--worker", str(w),
                "--address", self.lan.worker_ip(w), "--gateway", f"{self.gateway[0]}:{self.gateway[1]}",
                "--job", str(self.job), "--mode", self.mode, *secret],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
            log.close()

    def wait_ready(self) -> None:
        """Block until every aggregator said it is ready (its program loaded and attached)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        for w, proc in self.procs.items():
            self.ready[w] = json.loads(_readline(proc, deadline, f"aggregator {w}", self.log_dir))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def close(self) -> None:
        """Close their stdin (they stop), collect their last line, and make sure they are gone."""
        for w, proc in self.procs.items():
            try:
                assert proc.stdin is not None
                proc.stdin.close()
                line = _readline(proc, time.monotonic() + 30.0, f"aggregator {w}", self.log_dir)
                self.final[w] = json.loads(line)
                proc.wait(timeout=30)
            except (OSError, RuntimeError, TimeoutError, ValueError, subprocess.TimeoutExpired) as exc:
                # no last line: the run's result says why instead of losing the aggregator's counters silently
                self.final[w] = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def _readline(proc: subprocess.Popen[bytes], deadline: float, who: str, log_dir: Path) -> str:
    assert proc.stdout is not None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{who} said nothing before its deadline, {-left:.1f} s ago (log in {log_dir})")
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            line = proc.stdout.readline()
            if not line:
                tail = ""
                logs = sorted(log_dir.glob(f"{who.replace(' ', '-')}.log"))
                if logs:
                    tail = logs[0].read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{who} exited with {proc.wait()}: {tail}")
            return line.decode().strip()


class Workers:
    """The LAN workers, one process each in its namespace (``edge_worker.py``)."""

    def __init__(self, lan: Any, *, gateway: tuple[str, int], job: int, args: Any, lanes: int, pool: int,
                 precisions: list[str], seed: int, first: int, log_dir: Path, transport: str = "udp") -> None:
        self.lan = lan
        self.log_dir = log_dir
        self.argv = ["--workers", str(len(lan.workers)), "--gateway", f"{gateway[0]}:{gateway[1]}", "--job", str(job),
                     "--elements", str(args.elements), "--iterations", str(args.iterations), "--first", str(first),
                     "--scale", str(args.scale), "--lanes", str(lanes), "--pool", str(pool), "--seed", str(seed),
                     "--precisions", ",".join(precisions), "--transport", transport,
                     "--loss", str(args.loss if transport == "udp" else 0.0),
                     *(["--no-gso"] if getattr(args, "no_gso", False) else []),
                     *(["--no-gro"] if getattr(args, "no_gro", False) else []),
                     "--timeout", str(60.0 + args.elements * 4 * len(lan.workers) * 8 / 2e7),
                     *(["--secret-file", args.secret_file] if args.secret_file else [])]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.windows: list[dict[str, Any]] = []
        self.checks: list[dict[str, Any]] = []

    def spawn(self) -> None:
        from netstorm.emulation import netns

        for i, ns in enumerate(self.lan.workers):
            log = (self.log_dir / f"worker-{i}.log").open("wb")
            self.procs.append(netns.spawn(ns, [
                sys.executable, "-m", "netstorm.bench.edge_worker", "--worker", str(i),
                "--address", self.lan.worker_ip(i), *self.argv],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log))
            log.close()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for i, proc in enumerate(self.procs):
            line = _readline(proc, deadline, f"worker {i}", self.log_dir)
            if line != "ready":
                raise RuntimeError(f"worker {i} said {line!r} instead of ready")

    def go(self) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            proc.stdin.flush()

    def wait_done(self, timeout: float) -> None:
        """Every worker's window line (its iterations are done)."""
        deadline = time.monotonic() + timeout
        self.windows = [json.loads(_readline(p, deadline, f"worker {i}", self.log_dir))
                        for i, p in enumerate(self.procs)]

    def wait_checked(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self.checks = [json.loads(_readline(p, deadline, f"worker {i}", self.log_dir))
                       for i, p in enumerate(self.procs)]
        for i, p in enumerate(self.procs):
            if p.wait(timeout=max(1.0, deadline - time.monotonic())) != 0:
                raise RuntimeError(f"worker {i} exited with {p.returncode}")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

def expected_sums(args: argparse.Namespace, seed: int, precisions: list[str], lanes: int) -> list[np.ndarray]:
    """Each measured iteration's exact sum, from the same quantised inputs the workers send (``--elements``,
    ``--scale``, ``--iterations``, ``--workers``): what every path's result must equal."""
    from netstorm.bench.edge_inputs import contribution, reference

    workers = args.workers
    if all(p == "fp32" for p in precisions):
        return [reference(seed, k, workers, args.elements, args.scale) for k in range(args.iterations)]
    return [mixed_reference([contribution(seed, k, w, args.elements, args.scale, workers) for w in range(workers)],
                            precisions, lanes, args.scale)
            for k in range(args.iterations)]
