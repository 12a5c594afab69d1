"""What a run's result keeps of the scheduler: the policy version bound to each iteration, every version
published (why, roots, trees), each gateway's LAN aggregation mode and what the first probe round
measured, read from the scheduler's admin interface while the run goes.

The scheduler remembers a bounded window of bindings and versions, so ``SchedulerWatch`` asks for what
is new every ``interval`` seconds from a thread inside the management namespace (where the scheduler
listens), and once more when the run ends, before the scheduler stops. ``SchedulerRecord`` is the
record itself: plain data fed with admin answers, and the result fields made from it. The fields are
the ones the scheduler's log lines used to be parsed for, so results stay comparable.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable
from typing import Any

from netstorm import control
from netstorm.authconn import Credentials
from netstorm.control import ControlError
from netstorm.emulation.netns import enter
from scheduler import admin

log = logging.getLogger(__name__)

OVERLAP = 16
"""Iterations below the newest binding seen that each request asks for again: a node may bind an
iteration out of order (a prefetch), and one a little older than the newest must not be missed."""
NOT_STARTED = "not started"


def edge_mode_text(mode: str, fallback: str) -> str:
    """A gateway's aggregation mode, with the reason when XDP fell back to userspace (one line)."""
    return f"{mode} (XDP unavailable: {' '.join(fallback.split())})" if fallback else mode


class SchedulerRecord:
    """Bindings, published versions and gateway modes, as the admin interface told them."""

    def __init__(self) -> None:
        self.bound: dict[int, int] = {}
        self.policies: dict[int, control.PolicyRecord] = {}
        self.edge: dict[int, tuple[str, str]] = {}
        self.probed: tuple[tuple[int, int, float, str], ...] = ()
        self.probe_s = -1.0
        self._lock = threading.Lock()

    def next_request(self, *, overlap: int = 0) -> control.HistoryRequest:
        """What to ask for next: past what is held, with ``overlap`` iterations below it asked again (the
        first page of a poll; later pages go on from the newest, so paging always moves on)."""
        with self._lock:
            since_iteration = max(0, max(self.bound, default=-1) + 1 - overlap)
            return control.HistoryRequest(since_iteration, max(self.policies, default=-1) + 1)

    def add_history(self, history: control.History) -> bool:
        """Take one page; True when it brought news (a full page may have more behind it)."""
        with self._lock:
            news = False
            for iteration, version in history.bindings:
                news |= self.bound.get(iteration) != version
                self.bound[iteration] = version
            for record in history.policies:
                news |= record.version not in self.policies
                self.policies[record.version] = record
            return news

    def add_status(self, status: control.Status) -> None:
        with self._lock:
            self.edge.update(status.edge)
            if status.probed:  # a scheduler restarted from its state ran no round: keep the first one's
                self.probed, self.probe_s = status.probed, status.probe_s

    def probe(self) -> tuple[tuple[tuple[int, int, float, str], ...], float]:
        """The scheduler's first probe round: (src, dst, Mbit/s or -1, why not) per link with no rate, and
        the seconds it took (empty and -1 when none ran or it was not seen)."""
        with self._lock:
            return self.probed, self.probe_s

    def policy_versions(self) -> dict[str, Any]:
        """The result's ``policy_versions``: ``bound`` (iteration -> version; the scheduler's iteration
        numbers, the runtime's own count) and ``policies`` (version, reason, roots as ``[1, 2]``)."""
        with self._lock:
            return {"bound": {str(k): v for k, v in sorted(self.bound.items())},
                    "policies": [{"version": r.version, "reason": r.reason, "roots": str(list(r.roots))}
                                 for _, r in sorted(self.policies.items())]}

    def policy_trees(self) -> dict[str, dict[str, dict[str, int | None]]]:
        """The result's ``policy_trees``: per published version, its trees as ``netstorm plan --json``
        prints them (``{"<root>": {"<node>": parent or null}}``), so a run shows what each policy built."""
        with self._lock:
            return {str(version): {str(root): {str(n): p for n, p in sorted({root: None, **children}.items())}
                                   for root, children in record.trees().items()}
                    for version, record in sorted(self.policies.items())}

    def edge_modes(self, gateways: Iterable[int]) -> dict[str, str]:
        """The result's ``edge_mode``: per gateway DC, ``xdp (native)``, ``xdp (generic)`` or ``userspace``
        (with XDP's reason for falling back), ``not started`` when it never served its LAN."""
        with self._lock:
            return {str(dc): edge_mode_text(*self.edge[dc]) if dc in self.edge else NOT_STARTED for dc in gateways}


class SchedulerWatch:
    """Follows a scheduler's admin interface from a thread (inside ``namespace``, if given) into ``record``."""

    def __init__(self, address: tuple[str, int], record: SchedulerRecord, *, namespace: str | None = None,
                 interval: float = 0.5, timeout: float = 5.0, credentials: Credentials | None = None) -> None:
        self.address = address
        self.credentials = credentials
        self.record = record
        self.namespace = namespace
        self.interval = interval
        self.timeout = timeout
        self.error: str | None = None
        """Why the latest poll failed (None once one succeeds)."""
        self.polls = 0
        """Polls that got their answers (tests wait on it)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scheduler-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Poll a last time (the run is over, the scheduler still up) and end the thread."""
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> SchedulerWatch:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            if self.namespace is not None:
                enter(self.namespace)  # this thread only: its sockets live in the namespace
        except Exception as exc:  # reported in the result, the run goes on
            self.error = f"cannot enter {self.namespace}: {exc}"
            log.warning("scheduler watch: %s", self.error)
            return
        while True:
            last = self._stop.wait(self.interval)
            try:
                asyncio.run(self.poll())
                self.error = None
            except (ControlError, OSError) as exc:
                if self.error != str(exc):
                    log.info("scheduler watch: %s", exc)
                self.error = str(exc)
            if last:
                return

    async def poll(self) -> None:
        """Ask again for the last few iterations, then for every page that is new, then for the status."""
        request = self.record.next_request(overlap=OVERLAP)
        self.record.add_history(await admin.history(self.address, request.since_iteration, request.since_version,
                                                    timeout=self.timeout, credentials=self.credentials))
        while True:
            request = self.record.next_request()
            page = await admin.history(self.address, request.since_iteration, request.since_version,
                                       timeout=self.timeout, credentials=self.credentials)
            if not self.record.add_history(page):
                break
        self.record.add_status(await admin.status(self.address, timeout=self.timeout, credentials=self.credentials))
        self.polls += 1
