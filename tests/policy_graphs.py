"""Rate graphs shared by the policy tests."""

from __future__ import annotations

from netstorm import scenario
from netstorm.bench.policy import random_overlay
from netstorm.scenario import Rates

__all__ = ["internet2", "internet2_redrawn", "random_overlay"]


def internet2(scale: float = 1.0) -> Rates:
    """The static internet2-9 scenario's directed rates, multiplied by ``scale``."""
    return {pair: rate * scale for pair, rate in scenario.load("internet2-9").rates().items()}


def internet2_redrawn(epoch: int, scale: float = 0.25) -> Rates:
    """The dynamic internet2-9 scenario's rates after ``epoch`` re-draws, multiplied by ``scale``."""
    _, rates = list(scenario.load("internet2-9-dynamic").rate_schedule((epoch + 1) * 180.0))[epoch]
    return {pair: rate * scale for pair, rate in rates.items()}
