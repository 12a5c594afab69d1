"""The one helper around ``ip netns`` and ``tc``: namespaces, batches of commands, processes inside
namespaces, and threads that enter a namespace.

Every failure raises EmulationError naming the step and quoting the tool's own message.

Code can also run "inside" a namespace without a process of its own: ``setns(2)`` moves only the calling
thread, and every socket (and thread) it creates afterwards lives in that namespace. ``run_in`` runs a
function on such a thread and returns its result; ``run_async_in`` runs a coroutine's own event loop
there, like a process on its own host, and hands the result back as a future.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

from netstorm.emulation.errors import EmulationError

_PR_SET_PDEATHSIG = 1
_CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")
T = TypeVar("T")


def run(argv: Sequence[str], *, what: str, stdin: str | None = None, check: bool = True) -> str:
    """Run a tool, return its stdout; raise EmulationError naming ``what`` when it fails."""
    try:
        proc = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise EmulationError(f"{what}: {argv[0]} is not installed (iproute2 is required)") from None
    except subprocess.TimeoutExpired:
        raise EmulationError(f"{what}: {' '.join(argv)} did not finish within 60 s") from None
    if check and proc.returncode != 0:
        message = (proc.stderr or proc.stdout).strip()
        raise EmulationError(f"{what}: `{' '.join(argv)}` failed: {message}")
    return proc.stdout


def ip_batch(lines: Sequence[str], *, namespace: str | None = None, what: str) -> None:
    """Run ``ip`` commands in one process (``-batch``), optionally inside ``namespace``."""
    if not lines:
        return
    argv = ["ip", *(["-n", namespace] if namespace else []), "-batch", "-"]
    run(argv, what=what, stdin="\n".join(lines) + "\n")


def tc_batch(lines: Sequence[str], *, namespace: str, what: str) -> None:
    """Run ``tc`` commands in one process inside ``namespace``."""
    if not lines:
        return
    run(["tc", "-n", namespace, "-batch", "-"], what=what, stdin="\n".join(lines) + "\n")


def list_namespaces() -> list[str]:
    out = run(["ip", "netns", "list"], what="list network namespaces")
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def add_namespace(name: str) -> None:
    run(["ip", "netns", "add", name], what=f"create namespace {name}")


def delete_namespace(name: str) -> None:
    """Delete ``name``; veth pairs with an end inside it disappear with it. Absent is fine."""
    if namespace_exists(name):
        run(["ip", "netns", "delete", name], what=f"delete namespace {name}")


def sysctl(namespace: str, settings: Mapping[str, str]) -> None:
    """Write ``/proc/sys`` values inside ``namespace`` (one ``sysctl`` process)."""
    argv = ["ip", "netns", "exec", namespace, "sysctl", "-q", "-w", *(f"{k}={v}" for k, v in settings.items())]
    run(argv, what=f"sysctl in {namespace}")


def pids_in(namespace: str) -> list[int]:
    """Processes whose network namespace is ``namespace`` (empty when it does not exist)."""
    if not namespace_exists(namespace):
        return []
    out = run(["ip", "netns", "pids", namespace], what=f"list processes in {namespace}", check=False)
    return [int(tok) for tok in out.split() if tok.isdigit()]


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the launching process dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(namespace: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
          stdout: IO[bytes] | int | None = None, stderr: IO[bytes] | int | None = None,
          stdin: IO[bytes] | int | None = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
    """Start ``argv`` inside ``namespace`` in its own process group (``ip netns exec`` execs it, same pid)."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    try:
        return subprocess.Popen(["ip", "netns", "exec", namespace, *argv], env=full_env, stdout=stdout,
                                stderr=stderr, stdin=stdin, start_new_session=True,
                                preexec_fn=_die_with_parent)
    except OSError as exc:
        raise EmulationError(f"start {argv[0]} in {namespace}: {exc}") from None


def terminate(pids: Sequence[int], *, grace_s: float = 3.0) -> list[int]:
    """SIGTERM ``pids``, SIGKILL whatever is left after ``grace_s``; returns the pids that were signalled."""
    signalled: list[int] = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
            signalled.append(pid)
    deadline = time.monotonic() + grace_s
    alive = list(signalled)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _alive(pid)]
        if alive:
            time.sleep(0.05)
    for pid in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return signalled


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (reaped or not, a zombie holds no resources)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), to tell a live owner from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def enter(namespace: str) -> None:
    """Move the calling thread into network namespace ``namespace``."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        fd = os.open(NETNS_DIR / namespace, os.O_RDONLY)
    except OSError as exc:
        raise EmulationError(f"enter namespace {namespace}: {exc.strerror}") from None
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise EmulationError(f"enter namespace {namespace}: setns: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def run_in(namespace: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on a thread that has entered ``namespace``; returns its result (or raises its error)."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            enter(namespace)
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=body, name=f"netns-{namespace}")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


def run_async_in(namespace: str, main: Callable[[], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
    """Run ``asyncio.run(main())`` on a new thread inside ``namespace``; its result comes as a future."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def target() -> None:
        try:
            enter(namespace)
            future.set_result(asyncio.run(main()))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=target, name=f"netns-{namespace}", daemon=True).start()
    return future
