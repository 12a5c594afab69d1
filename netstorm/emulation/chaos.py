"""The chaos schedule of an emulated run (``netstorm emulate ... --chaos SPEC``), parsed and checked.

A spec is a comma-separated list of ``ACTION[:TARGET]@TIME``, TIME in seconds (``20s`` or ``20``) from
the start of the measured run:

- ``kill-dc:3@20s`` / ``restart-dc:3@35s``: SIGKILL DC 3's node (and its trainer), then start both
  again with their original command lines;
- ``kill-scheduler@50s`` / ``restart-scheduler@60s``;
- ``link-down:2-5@70s`` / ``link-up:2-5@80s``: the overlay link between DCs 2 and 5, both directions.

The schedule must make sense as a whole, so a typo fails before any namespace is built: a restart
follows a kill of the same target, nothing is killed twice without a restart between, a link goes
up only after it went down, and DCs and links exist in the scenario.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from netstorm.errors import ConfigError

log = logging.getLogger(__name__)

ACTIONS = ("kill-dc", "restart-dc", "kill-scheduler", "restart-scheduler", "link-down", "link-up")
_ITEM = re.compile(r"(?P<action>[a-z-]+)(?::(?P<target>[0-9]+(?:-[0-9]+)?))?@(?P<at>[0-9]+(?:\.[0-9]+)?)s?")


@dataclasses.dataclass(frozen=True, order=True)
class Fault:
    """One scheduled fault or repair."""

    at: float
    """Seconds from the start of the measured run."""
    action: str
    target: tuple[int, ...] = ()
    """(dc,) for DC actions, (a, b) with a < b for links, () for the scheduler."""

    def __str__(self) -> str:
        target = "-".join(map(str, self.target))
        return f"{self.action}{':' + target if target else ''}@{self.at:g}s"

    @property
    def repairs(self) -> bool:
        """It brings something back (a restart, a link up): recovery is timed from the fault before."""
        return self.action in ("restart-dc", "restart-scheduler", "link-up")


def parse(spec: str, *, dcs: Collection[int], links: Collection[tuple[int, int]]) -> list[Fault]:
    """The faults of ``spec`` in time order; ConfigError naming the item and what is wrong."""
    faults = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        match = _ITEM.fullmatch(item)
        if match is None:
            raise ConfigError(f"--chaos item {item!r}: expected ACTION[:TARGET]@SECONDS, e.g. kill-dc:3@20s")
        action, target_text = match["action"], match["target"]
        if action not in ACTIONS:
            raise ConfigError(f"--chaos item {item!r}: unknown action {action!r} (known: {', '.join(ACTIONS)})")
        faults.append(Fault(float(match["at"]), action, _target(item, action, target_text, dcs, links)))
    if not faults:
        raise ConfigError("--chaos: empty schedule")
    faults.sort()
    _check_order(faults)
    return faults


def _target(item: str, action: str, text: str | None, dcs: Collection[int],
            links: Collection[tuple[int, int]]) -> tuple[int, ...]:
    if action.endswith("scheduler"):
        if text is not None:
            raise ConfigError(f"--chaos item {item!r}: {action} takes no target")
        return ()
    if text is None:
        raise ConfigError(f"--chaos item {item!r}: {action} needs a target ({'DC' if 'dc' in action else 'A-B'})")
    parts = tuple(int(p) for p in text.split("-"))
    if action.endswith("-dc"):
        if len(parts) != 1 or parts[0] not in dcs:
            raise ConfigError(f"--chaos item {item!r}: no DC {text} in this scenario (DCs {sorted(dcs)})")
        return parts
    if len(parts) != 2:
        raise ConfigError(f"--chaos item {item!r}: a link is A-B")
    a, b = sorted(parts)
    if (a, b) not in links and (b, a) not in links:
        raise ConfigError(f"--chaos item {item!r}: no overlay link between DCs {a} and {b}")
    return (a, b)


def _check_order(faults: list[Fault]) -> None:
    broken: dict[tuple[str, tuple[int, ...]], Fault] = {}
    for fault in faults:
        kind = "link" if fault.action.startswith("link") else fault.action.split("-", 1)[1]
        key = (kind, fault.target)
        if fault.repairs:
            if key not in broken:
                raise ConfigError(f"--chaos: {fault} repairs something no earlier item broke")
            del broken[key]
        else:
            if key in broken:
                raise ConfigError(f"--chaos: {fault} while {broken[key]} is not repaired yet")
            broken[key] = fault
    if len({(f.at, f.action, f.target) for f in faults}) != len(faults):
        raise ConfigError("--chaos: an item is listed twice")


class ChaosPlayer:
    """Carries out a schedule from an anchor on (the first iteration's end, like the rate dynamics): one
    thread, each fault at its time, through ``apply(fault)``; ``log`` keeps when each was done."""

    def __init__(self, faults: list[Fault], apply: Callable[[Fault], None]) -> None:
        self.faults = faults
        self.apply = apply
        self.log: list[dict[str, Any]] = []
        """{"fault", "action", "target", "t"}: wall-clock time it was done; "error" if it failed."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def anchor(self) -> None:
        """Start the schedule now."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(time.monotonic(),), name="chaos", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self, origin: float) -> None:
        for fault in self.faults:
            if self._stop.wait(max(0.0, origin + fault.at - time.monotonic())):
                return
            entry: dict[str, Any] = {"fault": str(fault), "action": fault.action, "target": list(fault.target),
                                     "t": time.time()}
            try:
                self.apply(fault)
            except Exception as exc:  # recorded in the result: a chaos run reports what it could not do
                log.warning("chaos: %s failed: %s", fault, exc)
                entry["error"] = str(exc)
            self.log.append(entry)
        # The processes restarted from this thread die with it (they ask for SIGTERM when their parent
        # thread ends): it lives until the run is over.
        self._stop.wait()
