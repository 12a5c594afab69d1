"""When the scheduler re-plans, as a sans-I/O core: the service feeds it events and times.

See docs/ARCHITECTURE.md, *The WAN tier: planning and the scheduler*."""

from __future__ import annotations

import enum

from netstorm.planning.predict import busiest_link_s
from netstorm.policy import Policy
from netstorm.scenario import Rates


class Reason(enum.Enum):
    MEMBERSHIP = "node down"
    SHIFT = "measured rate shift"
    PERIODIC = "periodic update"


def shifted(planned: Rates | None, link: tuple[int, int], mbit_s: float, react_change: float) -> bool:
    """Whether a report of ``mbit_s`` on ``link`` is far enough from the planned rate to re-plan early."""
    if react_change <= 0 or planned is None or link not in planned:
        return False
    before = planned[link]
    return abs(mbit_s - before) > react_change * before


def slows(policy: Policy, planned: Rates, believed: Rates, react_change: float) -> bool:
    """Whether the ``believed`` rates make ``policy``'s busiest link take more than ``react_change``
    longer than at the ``planned`` rates it was made for (links ``believed`` lacks keep their plan)."""
    now = {link: believed.get(link, rate) for link, rate in planned.items()}
    return busiest_link_s(policy, now) > (1 + react_change) * busiest_link_s(policy, planned)


class Cadence:
    """The next re-plan's time and reason; ``start`` records that one began."""

    def __init__(self, *, update_time: float, react_interval: float, now: float) -> None:
        if update_time <= 0 or react_interval < 0:
            raise ValueError(f"update_time ({update_time}) must be positive and react_interval "
                             f"({react_interval}) >= 0")
        self.update_time = update_time
        self.react_interval = react_interval
        self._last = now
        self._membership = False
        self._change = False
        self._shift = False

    def member_down(self) -> None:
        self._membership = True

    def change(self) -> None:
        """The network changed: re-plan now, whatever the last cycle was."""
        self._change = True

    def shift(self) -> None:
        self._shift = True

    def due(self) -> float:
        """The time the next re-plan should start (may be in the past: start now)."""
        if self._membership or self._change:
            return self._last
        if self._shift:
            return self._last + min(self.react_interval, self.update_time)
        return self._last + self.update_time

    def reason(self) -> Reason:
        if self._membership:
            return Reason.MEMBERSHIP
        return Reason.SHIFT if self._shift or self._change else Reason.PERIODIC

    def start(self, now: float) -> Reason:
        """A re-plan starts at ``now``: its reason; pending signals are consumed."""
        reason = self.reason()
        self._last = now
        self._membership = self._change = self._shift = False
        return reason
