"""Rate graphs shared by the policy tests."""

from __future__ import annotations

from netstorm import scenario
from netstorm.bench.policy import random_overlay
from netstorm.scenario import Rates

__all__ = ["internet2", "random_overlay"]


def internet2(scale: float = 1.0) -> Rates:
    """The static internet2-9 scenario's directed rates, multiplied by ``scale``."""
    return {pair: rate * scale for pair, rate in scenario.load("internet2-9").rates().items()}
