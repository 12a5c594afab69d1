"""Start a ``netstorm local`` cluster on loopback and one trainer process per DC; tear all of it down.

Benchmarks, the PyTorch example and end-to-end tests share this: a scenario of ``n`` DCs written to
the run directory (or a given one), ``netstorm local`` waited on until it prints ``READY``, trainers as
child processes whose JSON lines are collected by one reader thread each. Everything started here is
stopped here, on success and on failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from netstorm.errors import NetStormError
from netstorm.trainers.realdata import NAMES as REALDATA
from netstorm.trainers.tasks import TASKS

TRAINERS = ("synthetic", "torch-ddp", "diloco")
"""What ``netstorm emulate --trainer`` runs in each DC; the first is the default."""
TRAINS: dict[str, tuple[str, ...]] = {"synthetic": (), "torch-ddp": tuple(TASKS), "diloco": REALDATA}
"""Each trainer's ``--train`` tasks, the first its default: generated ones for torch-ddp, DiLoCo's real data
for diloco (whose per-step references run torch-ddp on the same data); the synthetic trainer takes ``--model``."""


def diloco_args(module: str, train: str, *, dc_index: int, dcs: int, sync_every: int, fragments: int,
                fragment_delay: int, outer_compression: str, compute_s: float, steps: int, seed: int, out: Path,
                endpoint: Sequence[str]) -> list[str]:
    """A DiLoCo trainer's command line after the interpreter: ``netstorm/trainers/diloco_run.py``'s flags,
    which the torchft one shares, ``endpoint`` the flags that say where its DC's runtime is (``--socket``)."""
    return ["-m", module, *endpoint, "--train", train, "--dc-index", str(dc_index), "--dcs", str(dcs),
            "--sync-every", str(sync_every), "--fragments", str(fragments), "--fragment-delay", str(fragment_delay),
            "--outer-compression", outer_compression, "--compute-s", str(compute_s), "--steps", str(steps),
            "--seed", str(seed), "--out", str(out)]


def torch_ddp_args(backend: str, task: str, *, rank: int, world: int, dc: int, iterations: int, out: Path,
                   socket: str | None = None, store: str | None = None, address: str | None = None,
                   compression: Sequence[str] = (), extra: Sequence[str] = ()) -> list[str]:
    """The torch-ddp trainer's command line after the interpreter (``netstorm/trainers/torch_ddp.py``);
    ``compression``: its ``--compression`` and ``--fediac-*`` flags; ``extra``: any other of its flags."""
    argv = ["-m", "netstorm.trainers.torch_ddp", "--backend", backend, "--task", task, "--rank", str(rank),
            "--world", str(world), "--dc", str(dc), "--iterations", str(iterations), "--out", str(out)]
    if socket is not None:
        argv += ["--socket", socket]
    if store is not None and address is not None:
        argv += ["--store", store, "--address", address]
    return argv + list(compression) + list(extra)


class LaunchError(NetStormError):
    """A cluster or trainer did not start, or stopped early; the message carries its log tail."""


def ring_scenario(n: int, *, rate_mbit: float = 1000.0, name: str = "loopback") -> str:
    """TOML of ``n`` DCs (ids 1..n) on a ring with chords i -> i+2: connected, a few paths per pair."""
    if n < 2:
        raise ValueError(f"a cluster needs at least 2 DCs, got {n}")
    lines = [f'name = "{name}-{n}"', "", "[defaults]", "latency_ms = 0.0", "loss_pct = 0.0", ""]
    for i in range(1, n + 1):
        lines += ["[[node]]", f"id = {i}", ""]
    edges = {tuple(sorted((i, i % n + 1))) for i in range(1, n + 1)}
    if n > 4:
        edges |= {tuple(sorted((i, (i + 1) % n + 1))) for i in range(1, n + 1)}
    for a, b in sorted(edges):
        lines += ["[[link]]", f"a = {a}", f"b = {b}", f"rate_mbit = {rate_mbit}", ""]
    return "\n".join(lines)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop(process: subprocess.Popen[Any], *, timeout: float) -> None:
    """SIGTERM, wait, then SIGKILL; a child of it that outlives it (its own handler failed) is killed too."""
    if process.poll() is not None:
        return
    children = {pid: _start_time(pid) for pid in descendants(process.pid)}
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout)
    for pid, started in children.items():
        if started is not None and _start_time(pid) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _stat(pid: int) -> list[str]:
    """Fields of /proc/<pid>/stat after the command name (state first)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _parent(pid: int) -> int:
    return int(_stat(pid)[1])


def _start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot), None once it is gone: tells a reused pid apart."""
    try:
        return int(_stat(pid)[19])
    except (OSError, IndexError, ValueError):
        return None


def descendants(root: int) -> list[int]:
    """Every live process below ``root``, found by walking /proc's parent links."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = _parent(int(entry))
            except (OSError, IndexError, ValueError):
                continue  # exited while we looked
    found: list[int] = []
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid]
        found += children
        frontier += children
    return sorted(found)


@dataclasses.dataclass
class Cluster:
    """A running ``netstorm local``: its process, run directory and each DC's trainer socket."""

    process: subprocess.Popen[bytes]
    run_dir: Path
    node_ids: list[int]

    def socket(self, node_id: int) -> str:
        return str(self.run_dir / f"node-{node_id}.sock")


def _drain(stream: IO[bytes], sink: IO[bytes]) -> None:
    for line in iter(stream.readline, b""):
        sink.write(line)
        sink.flush()


@contextlib.contextmanager
def local_cluster(n: int, run_dir: Path, *, flags: Sequence[str] = (), ready_timeout: float = 60.0,
                  scenario: Path | None = None) -> Iterator[Cluster]:
    """``netstorm local`` over ``n`` DCs in ``run_dir``; yields once it printed READY, stops it on exit."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if scenario is None:
        scenario = run_dir / "scenario.toml"
        scenario.write_text(ring_scenario(n))
    log_path = run_dir / "local.log"
    argv = [sys.executable, "-m", "netstorm.cli", "local", str(scenario), "--run-dir", str(run_dir), *flags]
    with log_path.open("wb") as log:
        # Unbuffered: select() sees the pipe, so no line may wait in a reader's buffer.
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, bufsize=0)
        assert process.stdout is not None
        drain: threading.Thread | None = None
        try:
            deadline = time.monotonic() + ready_timeout
            ready = False
            while not ready:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LaunchError(f"netstorm local printed no READY within {ready_timeout:g} s; "
                                      f"log {log_path}:\n{_tail(log_path)}")
                readable, _, _ = select.select([process.stdout], [], [], left)
                if not readable:
                    continue
                line = process.stdout.readline()
                if not line:
                    process.wait(timeout=10)
                    raise LaunchError(f"netstorm local exited ({process.returncode}) before READY; "
                                      f"log {log_path}:\n{_tail(log_path)}")
                log.write(line)
                ready = line.startswith(b"READY")
            log.flush()
            drain = threading.Thread(target=_drain, args=(process.stdout, log), daemon=True)
            drain.start()
            yield Cluster(process, run_dir, list(range(1, n + 1)))
        finally:
            _stop(process, timeout=20.0)
            if drain is not None:
                drain.join(timeout=5.0)


@dataclasses.dataclass(frozen=True)
class Line:
    """One JSON line from trainer ``index``, or its end (``record`` None) with its exit code."""

    index: int
    record: dict[str, Any] | None
    returncode: int | None = None


class Trainers:
    """Trainer child processes writing JSON lines on stdout, collected into one queue."""

    def __init__(self, argvs: Sequence[Sequence[str]], log_dir: Path) -> None:
        self.lines: queue.Queue[Line] = queue.Queue()
        self.processes: list[subprocess.Popen[bytes]] = []
        self.logs = [log_dir / f"trainer-{i}.log" for i in range(len(argvs))]
        self._threads: list[threading.Thread] = []
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        try:
            for i, argv in enumerate(argvs):
                with self.logs[i].open("wb") as log:
                    process = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=log,
                                               stdin=subprocess.DEVNULL, env=env)
                self.processes.append(process)
                thread = threading.Thread(target=self._read, args=(i, process), daemon=True)
                thread.start()
                self._threads.append(thread)
        except BaseException:
            self.stop()
            raise

    def _read(self, index: int, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        for raw in iter(process.stdout.readline, b""):
            try:
                record = json.loads(raw)
            except ValueError:
                record = {"unparsed": raw.decode(errors="replace").rstrip()}
            self.lines.put(Line(index, record if isinstance(record, dict) else {"value": record}))
        self.lines.put(Line(index, None, process.wait()))

    def next_line(self, *, timeout: float) -> Line:
        """The next line from any trainer; LaunchError naming the wait when none comes in time."""
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise LaunchError(f"no trainer reported within {timeout:g} s; logs: "
                              f"{', '.join(str(p) for p in self.logs)}") from None

    def log_tail(self, index: int) -> str:
        return _tail(self.logs[index])

    def stop(self) -> None:
        for process in self.processes:
            _stop(process, timeout=10.0)
        for thread in self._threads:
            thread.join(timeout=5.0)

    def __enter__(self) -> Trainers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def collect(trainers: Trainers, *, timeout: float) -> list[list[dict[str, Any]]]:
    """Every trainer's records until all have exited; LaunchError if one fails or output stalls."""
    records: list[list[dict[str, Any]]] = [[] for _ in trainers.processes]
    running = len(records)
    while running:
        line = trainers.next_line(timeout=timeout)
        if line.record is not None:
            records[line.index].append(line.record)
            continue
        running -= 1
        if line.returncode != 0:
            raise LaunchError(f"trainer {line.index} exited with {line.returncode}:\n{trainers.log_tail(line.index)}"
                              f"\nlast output: {records[line.index][-3:]}")
    return records
