"""``netstorm local``: a scheduler and one node per DC on loopback, as supervised child processes.

The scheduler and the nodes each bind a free loopback port themselves (``--listen 127.0.0.1:0``); the
scheduler prints its address, the nodes register theirs with it. Each child logs to
``RUN_DIR/<name>.log``. Once every node has registered and its trainer socket ``RUN_DIR/node-<i>.sock``
exists, one line ``READY <run-dir>`` goes to stdout so scripts can wait on it. SIGINT/SIGTERM stop every
child (SIGTERM, then SIGKILL after a grace period); children also get SIGTERM from the kernel if this
process dies, so none is ever orphaned. A child that dies makes the whole run exit non-zero with that
child's log tail; with ``keep_going`` (``--keep-going``) a node that dies after READY is only reported, so
the job goes on without that DC as it would on real hosts (the scheduler declares it dead and re-plans):
the run ends on a signal, the scheduler's death, or the last node's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from netstorm.authconn import Credentials
from netstorm.control import ControlError, format_address, parse_address
from netstorm.errors import NetStormError
from scheduler import admin

log = logging.getLogger(__name__)
T = TypeVar("T")

GRACE_S = 5.0
"""Seconds a child gets to exit after SIGTERM before SIGKILL."""
LISTEN_MARK = "scheduler listening on "
ADDRESS_FILE = "scheduler.address"
"""RUN_DIR/scheduler.address holds HOST:PORT of the scheduler (admin requests, e.g. a policy override)."""
UNIX_PATH_MAX = 107
"""Longest Unix socket path Linux accepts (sun_path is 108 bytes with the terminating NUL)."""
RUN_DIR_ENV = "NETSTORM_LOCAL_RUN_DIR"
"""Set in every child's environment: tells which run a process belongs to (and lets tests find them)."""


class LocalError(NetStormError):
    """The local cluster could not start or a child failed."""


@dataclasses.dataclass
class Child:
    name: str
    process: asyncio.subprocess.Process
    log_path: Path
    argv: tuple[str, ...] = ()
    """Its command line after ``netstorm``, so ``LocalCluster.restart`` can run it again."""

    def tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text[-lines:]) or "(empty log)"

    def describe_exit(self) -> str:
        code = self.process.returncode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
        return f"{self.name} {how}; last lines of {self.log_path}:\n{self.tail()}"


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the supervising process dies (Linux prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


@dataclasses.dataclass
class LocalCluster:
    scenario: str
    node_ids: Sequence[int]
    run_dir: Path
    scheduler_args: Sequence[str] = ()
    """Extra flags for the scheduler only (topology, roots, bw-scale)."""
    common_args: Sequence[str] = ()
    """Config flags for every child."""
    verbose: int = 0
    startup_timeout: float = 120.0
    credentials: Credentials | None = None
    """The job secret the children prove (their --secret-file), for asking the scheduler's status."""
    keep_going: bool = False
    """A node that dies after startup is reported, not fatal: the others and the scheduler keep running."""
    metrics_listen: str = ""
    """HOST:PORT of the scheduler's metrics; node i (in ``node_ids`` order) serves them on PORT + 1 + i
    (every child on a port of its own choosing with PORT 0); empty: no metrics."""
    children: list[Child] = dataclasses.field(default_factory=list)
    scheduler_address: tuple[str, int] | None = None

    def socket_path(self, node_id: int) -> Path:
        return self.run_dir / f"node-{node_id}.sock"

    async def _spawn(self, name: str, argv: Sequence[str], *, append: bool = False) -> Child:
        log_path = self.run_dir / f"{name}.log"
        cli = [sys.executable, "-m", "netstorm.cli", *(["-" + "v" * self.verbose] if self.verbose else [])]
        with log_path.open("ab" if append else "wb") as log_file:
            process = await asyncio.create_subprocess_exec(
                *cli, *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                start_new_session=True, preexec_fn=_die_with_parent,
                env={**os.environ, "PYTHONUNBUFFERED": "1", RUN_DIR_ENV: str(self.run_dir)})
        child = Child(name, process, log_path, tuple(argv))
        self.children.append(child)
        log.info("started %s (pid %d), log %s", name, process.pid, log_path)
        return child

    def child(self, name: str) -> Child:
        """The running (or last) process called ``name`` ("scheduler", "node-3")."""
        for child in reversed(self.children):
            if child.name == name:
                return child
        raise LocalError(f"no child called {name}")

    async def kill(self, name: str) -> None:
        """SIGKILL one child, as a crash would end it, and wait for it to be gone."""
        child = self.child(name)
        if child.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.process.kill()
        await child.process.wait()

    async def restart(self, name: str) -> Child:
        """Run a killed child again with its command line (the scheduler on the address it had bound, which
        its nodes reconnect to); its log continues."""
        old = self.child(name)
        if old.process.returncode is None:
            raise LocalError(f"{name} is still running")
        argv = list(old.argv)
        if name == "scheduler" and self.scheduler_address is not None:
            argv[argv.index("--listen") + 1] = format_address(self.scheduler_address)
        self.children.remove(old)
        return await self._spawn(name, argv, append=True)

    def _check_children(self) -> None:
        for child in self.children:
            if child.process.returncode is not None:
                raise LocalError(child.describe_exit())

    async def start(self) -> None:
        """Start everything and return once every node is registered and serving its trainer socket."""
        longest = max((self.socket_path(n) for n in self.node_ids), key=lambda p: len(bytes(p)))
        if len(bytes(longest)) > UNIX_PATH_MAX:
            raise LocalError(f"trainer socket path {longest} is longer than the {UNIX_PATH_MAX} bytes a Unix "
                             "socket allows; choose a shorter --run-dir")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for node_id in self.node_ids:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path(node_id).unlink()
        deadline = time.monotonic() + self.startup_timeout
        scheduler = await self._spawn("scheduler", ["scheduler", self.scenario, "--listen", "127.0.0.1:0",
                                                    *self.scheduler_args, *self.common_args,
                                                    *self._metrics_args(-1)])
        self.scheduler_address = await self._scheduler_address(scheduler, deadline)
        address = format_address(self.scheduler_address)
        (self.run_dir / ADDRESS_FILE).write_text(address + "\n")
        for node_id in self.node_ids:
            # Port 0: each node binds a free port itself and registers the bound address, so no port
            # chosen here can be taken by another process before the node binds it.
            await self._spawn(f"node-{node_id}", [
                "node", "--id", str(node_id), "--scheduler", address, "--listen", "127.0.0.1:0",
                "--socket", str(self.socket_path(node_id)), *self.common_args,
                *self._metrics_args(self.node_ids.index(node_id))])
        await self._wait_ready(deadline)

    def _metrics_args(self, index: int) -> list[str]:
        """``--metrics-listen`` for the scheduler (index -1) or the index-th node."""
        address = self.metrics_address(index)
        return ["--metrics-listen", address] if address else []

    def metrics_address(self, index: int) -> str:
        """Where the scheduler (index -1) or the index-th node serves its metrics ("" without metrics)."""
        if not self.metrics_listen:
            return ""
        host, _, port = self.metrics_listen.rpartition(":")
        return f"{host}:{int(port) + 1 + index if int(port) else 0}"

    async def __aenter__(self) -> LocalCluster:
        """Start (stopping whatever started if that fails); for tests that drive a cluster from Python."""
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def _scheduler_address(self, scheduler: Child, deadline: float) -> tuple[str, int]:
        while True:
            self._check_children()
            with contextlib.suppress(OSError):
                for line in scheduler.log_path.read_text(errors="replace").splitlines():
                    if line.startswith(LISTEN_MARK):
                        return parse_address(line[len(LISTEN_MARK):].split()[0])
            if time.monotonic() > deadline:
                raise LocalError(f"scheduler did not start listening within {self.startup_timeout} s; last lines "
                                 f"of {scheduler.log_path}:\n{scheduler.tail()}")
            await self._wait_for_exit(0.05)

    async def _wait_ready(self, deadline: float) -> None:
        assert self.scheduler_address is not None
        while True:
            self._check_children()
            try:
                status = await admin.status(self.scheduler_address, timeout=5.0, credentials=self.credentials)
            except ControlError as exc:
                status = None
                log.debug("scheduler status: %s", exc)
            sockets = all(self.socket_path(n).exists() for n in self.node_ids)
            if status is not None and status.complete and sockets:
                return
            if time.monotonic() > deadline:
                waiting = "no status" if status is None else (
                    f"registered {list(status.registered)} of {list(status.expected)}")
                missing = [str(self.socket_path(n)) for n in self.node_ids if not self.socket_path(n).exists()]
                raise LocalError(f"cluster not ready within {self.startup_timeout} s ({waiting}; missing trainer "
                                 f"sockets: {missing or 'none'})")
            await self._wait_for_exit(0.1)

    async def _wait_for_exit(self, seconds: float) -> None:
        """Sleep up to ``seconds``, waking early when any child exits."""
        waits = [asyncio.ensure_future(c.process.wait()) for c in self.children]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def wait_any_exit(self) -> Child:
        """The first of the running children to exit (any child, when none runs)."""
        running = [c for c in self.children if c.process.returncode is None] or self.children
        async with asyncio.TaskGroup() as tasks:
            waits = {tasks.create_task(c.process.wait()): c for c in running}
            done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
        return waits[next(iter(done))]

    async def wait_fatal_exit(self) -> Child:
        """The first child whose exit ends the run: any child, or with ``keep_going`` the scheduler or
        the last running node (each node that dies before is reported on stderr with its log tail)."""
        reported: set[int] = set()
        while True:
            exited = [c for c in self.children if c.process.returncode is not None and id(c) not in reported]
            if not exited:
                await self.wait_any_exit()
                continue
            nodes_left = [c for c in self.children if c.name != "scheduler" and c.process.returncode is None]
            for child in exited:
                if not self.keep_going or child.name == "scheduler" or not nodes_left:
                    return child
                print(f"netstorm local: {child.describe_exit()}\nnetstorm local: the job goes on without "
                      f"{child.name} (--keep-going)", file=sys.stderr, flush=True)
                reported.add(id(child))

    async def stop(self) -> None:
        """SIGTERM every child (nodes first), SIGKILL stragglers after GRACE_S, remove trainer sockets."""
        nodes = [c for c in self.children if c.name != "scheduler"]
        schedulers = [c for c in self.children if c.name == "scheduler"]
        for group in (nodes, schedulers):
            for child in group:
                if child.process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        child.process.send_signal(signal.SIGTERM)
            deadline = asyncio.get_running_loop().time() + GRACE_S  # one grace period for the whole group
            for child in group:
                try:
                    async with asyncio.timeout_at(deadline):
                        await child.process.wait()
                except TimeoutError:
                    log.warning("%s ignored SIGTERM for %s s: killing it", child.name, GRACE_S)
                    with contextlib.suppress(ProcessLookupError):
                        child.process.kill()
                    await child.process.wait()
        for path in [*(self.socket_path(n) for n in self.node_ids), self.run_dir / ADDRESS_FILE]:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


async def run_local(cluster: LocalCluster) -> int:
    """Start, print READY, run until a signal (exit 0) or a child's death (exit 1); always stop children."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    rc = 0
    try:
        await _supervise(cluster, stop)
    except* LocalError as group:
        for exc in group.exceptions:
            print(f"netstorm local: error: {exc}", file=sys.stderr, flush=True)
        rc = 1
    finally:
        try:
            await cluster.stop()  # a second Ctrl-C meanwhile only sets the event again: no half-done stop
        finally:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(signum)
    return rc


async def _unless_stopped(work: Coroutine[Any, Any, T], stop: asyncio.Event) -> asyncio.Task[T] | None:
    """Run ``work`` until it ends or ``stop`` is set: its finished task, or None (it was cancelled)."""
    async with asyncio.TaskGroup() as tasks:
        working = tasks.create_task(work)
        stopping = tasks.create_task(stop.wait())
        await asyncio.wait({working, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            working.cancel()
            return None
        stopping.cancel()
    return working


async def _supervise(cluster: LocalCluster, stop: asyncio.Event) -> None:
    """Returns when asked to stop; raises LocalError when a child fails."""
    if await _unless_stopped(cluster.start(), stop) is None:
        return
    assert cluster.scheduler_address is not None
    print(f"scheduler: {format_address(cluster.scheduler_address)} (logs in {cluster.run_dir})")
    for node_id in cluster.node_ids:
        print(f"node {node_id}: trainers connect with netstorm.connect({str(cluster.socket_path(node_id))!r})")
    print(f"READY {cluster.run_dir}", flush=True)
    exited = await _unless_stopped(cluster.wait_fatal_exit(), stop)
    if exited is not None:
        raise LocalError(f"a child died: {exited.result().describe_exit()}")
