"""torchft's Lighthouse (the quorum server its wheel carries, ``torchft._torchft.LighthouseServer``) as a
child process that stops cleanly.

``python -m netstorm.trainers.torchft_lighthouse --min-replicas N [--bind HOST:PORT]`` prints the address
replicas pass as ``--lighthouse`` on its first line of stdout (port 0 binds a free one) and runs until
SIGTERM or SIGINT, or until its stdin closes with ``--until-stdin-closes`` (so it dies with a parent
that never stopped it). ``Lighthouse`` starts one and stops it: SIGTERM, then SIGKILL after a grace.
"""

from __future__ import annotations

import argparse
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any

from netstorm.errors import ConfigError


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m netstorm.trainers.torchft_lighthouse")
    parser.add_argument("--min-replicas", type=int, required=True, help="replica groups a first quorum waits for")
    parser.add_argument("--bind", default="127.0.0.1:0", help="HOST:PORT (port 0: a free one)")
    parser.add_argument("--join-timeout-ms", type=int, default=60000,
                        help="how long a quorum waits for heartbeating stragglers")
    parser.add_argument("--quorum-tick-ms", type=int, default=100)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5000)
    parser.add_argument("--until-stdin-closes", action="store_true")
    return parser.parse_args(argv)


def advertised(bind: str, served: str) -> str:
    """The address to give replicas: the bound host (unless a wildcard) with the port the server took."""
    host = bind.rsplit(":", 1)[0].strip("[]")
    port = served.rsplit(":", 1)[1]
    if host in ("", "0.0.0.0", "::"):
        return served
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind=args.bind, min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms,
                              quorum_tick_ms=args.quorum_tick_ms, heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.until_stdin_closes:
        threading.Thread(target=_until_eof, args=(stop,), daemon=True).start()
    print(advertised(args.bind, server.address()), flush=True)
    while not stop.wait(0.5):
        pass
    server.shutdown()
    return 0


def _until_eof(stop: threading.Event) -> None:
    """Set ``stop`` once stdin closes (raw reads: a daemon thread in a buffered read aborts the exit)."""
    while os.read(0, 4096):
        pass
    stop.set()


class Lighthouse:
    """A Lighthouse child process: ``address`` once started; ``stop()`` (or leaving the ``with``) ends it."""

    def __init__(self, min_replicas: int, bind: str = "127.0.0.1:0", join_timeout_ms: int = 60000,
                 log: IO[bytes] | None = None, start_timeout: float = 30.0) -> None:
        if min_replicas < 1:
            raise ConfigError(f"a Lighthouse needs min_replicas >= 1, got {min_replicas}")
        self.command = [sys.executable, "-m", "netstorm.trainers.torchft_lighthouse", "--min-replicas",
                        str(min_replicas), "--bind", bind, "--join-timeout-ms", str(join_timeout_ms),
                        "--until-stdin-closes"]
        self.log = log
        self.start_timeout = start_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self.address = ""

    def start(self) -> str:
        self.process = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.log if self.log is not None else subprocess.DEVNULL,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert self.process.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.process.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + self.start_timeout
            while not sel.select(max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline or self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"the Lighthouse printed no address within {self.start_timeout} s")
        line = self.process.stdout.readline().decode().strip()
        if not line.startswith("http"):
            self.stop()
            raise RuntimeError(f"the Lighthouse exited before it printed its address ({line!r})")
        self.address = line
        return line

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited after ``grace`` seconds; its exit code."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()
        return process.returncode

    def __enter__(self) -> Lighthouse:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
