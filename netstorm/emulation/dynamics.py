"""Rate dynamics: re-draw every direction's rate on the scenario's schedule while a run goes on.

``schedule`` is pure (the scenario's epochs with times multiplied by ``time_scale``); ``DynamicsPlayer``
applies it to a live network from one thread, waiting on an event (so ``stop`` is immediate), and logs
each change with its timestamp: the run's link rate log.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from netstorm.scenario import Rates, Scenario

log = logging.getLogger(__name__)


class Reshapable(Protocol):
    bw_scale: float

    def set_rates(self, rates: Rates) -> None: ...


@dataclasses.dataclass(frozen=True)
class RateChange:
    t: float
    """Seconds after the player's start."""
    epoch: int
    rates: Rates
    """Scenario rates (Mbit/s) before --bw-scale."""


def schedule(scenario: Scenario, *, time_scale: float = 1.0, horizon_s: float = 7 * 24 * 3600.0) -> list[RateChange]:
    """Every epoch after the first that starts within ``horizon_s`` (emulated seconds)."""
    if time_scale <= 0:
        raise ValueError(f"time scale must be positive, got {time_scale}")
    if scenario.dynamics is None:
        return []
    out = []
    epochs = scenario.rate_schedule(horizon_s / time_scale)
    for epoch, (start, rates) in enumerate(epochs):
        if epoch == 0:
            continue
        out.append(RateChange(start * time_scale, epoch, rates))
    return out


def rate_log_entry(t: float, epoch: int, rates: Rates, bw_scale: float) -> dict[str, Any]:
    """One link-rate-log record: applied (scaled) Mbit/s per direction, keyed ``"a->b"``."""
    return {"t": round(t, 3), "epoch": epoch,
            "rates_mbit": {f"{a}->{b}": round(r * bw_scale, 4) for (a, b), r in sorted(rates.items())}}


class DynamicsPlayer:
    """Applies a schedule to ``network`` in a background thread until stopped."""

    def __init__(self, network: Reshapable, changes: list[RateChange], *,
                 clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[dict[str, Any]], None] | None = None) -> None:
        self._network = network
        self._changes = sorted(changes, key=lambda c: c.t)
        self._clock = clock
        self._on_change = on_change
        self._stop = threading.Event()
        self._anchored = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = 0.0
        self._origin = 0.0
        self.origin_s: float | None = None
        """When the schedule's clock started, in seconds after ``start`` (None until it has)."""
        self.log: list[dict[str, Any]] = []
        """Rate changes: ``t`` (when every link had its new rate), ``t_begin`` (when re-shaping began),
        ``epoch``, ``rates_mbit``."""
        self.wall_start = 0.0
        """Wall-clock time of ``start``: trainers stamp iterations in wall-clock time."""
        self.error: BaseException | None = None

    def start(self, initial: Rates, *, anchored: bool = False) -> None:
        """Log ``initial`` and play the schedule from now, or, when ``anchored``, from ``anchor()`` on.

        Log times are seconds after this call either way.
        """
        self._start = self._clock()
        self.wall_start = time.time()
        self._record(0.0, 0, initial)
        if not anchored:
            self.anchor()
        self._thread = threading.Thread(target=self._run, name="netstorm-dynamics", daemon=True)
        self._thread.start()

    def anchor(self) -> None:
        """Start the schedule's clock now: the change at ``t`` comes ``t`` seconds later. Once only, and
        not after ``stop``."""
        if self._anchored.is_set():
            return
        self._origin = self._clock()
        self.origin_s = round(self._origin - self._start, 3)
        self._anchored.set()

    def _record(self, t: float, epoch: int, rates: Rates, *, begin: float | None = None) -> None:
        entry = rate_log_entry(t, epoch, rates, self._network.bw_scale)
        if begin is not None:  # re-shaping the links took from ``begin`` to ``t``
            entry["t_begin"] = round(begin, 3)
        self.log.append(entry)
        if self._on_change is not None:
            self._on_change(entry)

    def _run(self) -> None:
        try:
            self._anchored.wait()  # stop() sets it too
            if self._stop.is_set():
                return
            for change in self._changes:
                delay = self._origin + change.t - self._clock()
                if self._stop.wait(max(0.0, delay)):
                    return
                begin = self._clock() - self._start
                self._network.set_rates(change.rates)
                self._record(self._clock() - self._start, change.epoch, change.rates, begin=begin)
                log.info("epoch %d: rates re-drawn at t=%.1f s", change.epoch, change.t)
        except BaseException as exc:  # reported by stop(): a failed re-shape must not pass silently
            self.error = exc

    def join(self, timeout: float) -> bool:
        """Wait until every change is applied (or one failed); True when the thread has ended."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Stop applying changes; re-raises a failure the thread hit."""
        self._stop.set()
        self._anchored.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.error is not None:
            raise self.error
