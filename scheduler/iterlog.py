"""What the nodes say their iterations took, set against the physical limit of each (sans-I/O).

An iteration's time is its slowest DC's (the job waits for it); its limit is M / λ for the rates its
policy was planned with (``netstorm.planning.limit``): ``netstorm status`` and the scheduler's metrics
show how far each of the newest iterations is from what its rates allow.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable, Mapping

from netstorm.errors import PolicyError
from netstorm.planning.limit import min_cut

RECENT = 32
"""Iterations whose times the log keeps."""
MIN_CUTS = 64
"""Policy versions whose min cut the log keeps."""


class IterationLog:
    """Iteration -> the slowest reported time; policy version -> λ, computed once per version."""

    def __init__(self, rates_of: Callable[[int], Mapping[tuple[int, int], float] | None]) -> None:
        self._rates_of = rates_of
        """Policy version -> the rates it was planned with (None when the version is not held)."""
        self.times: collections.OrderedDict[int, float] = collections.OrderedDict()
        self.versions: dict[int, int] = {}
        self.model_bytes = 0
        self.completed = 0
        """Distinct iterations some node reported complete."""
        self.seconds_total = 0.0
        """Sum of the completed iterations' times (their slowest DC's, as first reported)."""
        self._cuts: collections.OrderedDict[int, float] = collections.OrderedDict()

    def record(self, done: Iterable[tuple[int, float]], model_bytes: int,
               version_of: Callable[[int], int | None]) -> None:
        """A heartbeat's iteration times; ``version_of`` maps iterations to the versions bound to them."""
        if model_bytes > 0:
            self.model_bytes = model_bytes
        for iteration, seconds in done:
            known = self.times.get(iteration)
            if known is None:
                if self.times and iteration < next(iter(self.times)) and len(self.times) >= RECENT:
                    continue  # older than everything kept
                self.completed += 1
                self.seconds_total += seconds
                self.times[iteration] = seconds
                self.times = collections.OrderedDict(sorted(self.times.items()))
                while len(self.times) > RECENT:
                    self.times.popitem(last=False)
            elif seconds > known:
                self.seconds_total += seconds - known
                self.times[iteration] = seconds
            version = version_of(iteration)
            if version is not None:
                self.versions[iteration] = version
        for old in [i for i in self.versions if i not in self.times]:
            del self.versions[old]

    def min_cut_mbit(self, version: int) -> float | None:
        """λ of the rates policy ``version`` was planned with (None when they are unknown)."""
        cut = self._cuts.get(version)
        if cut is None:
            rates = self._rates_of(version)
            if not rates:
                return None
            try:
                cut = min_cut(rates).mbit
            except PolicyError:
                return None
            self._cuts[version] = cut
            while len(self._cuts) > MIN_CUTS:
                self._cuts.popitem(last=False)
        return cut

    def limit_s(self, version: int) -> float | None:
        """M / λ in seconds for policy ``version`` (None before the model's size or the rates are known)."""
        cut = self.min_cut_mbit(version)
        if cut is None or self.model_bytes <= 0 or not cut > 0 or math.isinf(cut):
            return None
        return self.model_bytes * 8 / (cut * 1e6)

    def rows(self) -> list[tuple[int, int, float, float]]:
        """(iteration, version or -1, seconds, limit or -1) of the newest iterations, oldest first."""
        out = []
        for iteration, seconds in self.times.items():
            version = self.versions.get(iteration, -1)
            limit = self.limit_s(version) if version >= 0 else None
            out.append((iteration, version, seconds, -1.0 if limit is None else limit))
        return out
