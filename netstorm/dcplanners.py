"""The DC planners (``dc_planner``): one registry that the config, the CLI, the scheduler and the
benchmarks read their names from.

An entry names its function as ``"module:attribute"``, a ``(LanSpec, dcplan.Options) -> DcPlan``; it is
imported only when a DC is planned, so the config and a node read the names without loading a solver.
"""

from __future__ import annotations

from dataclasses import dataclass

from netstorm.errors import ConfigError
from netstorm.registry import Registry


@dataclass(frozen=True)
class DcPlanner:
    target: str
    """``"module:attribute"`` of the planning function."""
    summary: str
    """One line for the CLI's help and the docs."""


DC_PLANNERS: Registry[DcPlanner] = Registry("DC planner", {
    "flat": DcPlanner("netstorm.planning.dcplan:flat_plan", "every worker sends to the gateway"),
    "aleph": DcPlanner("netstorm.planning.dcplan:aleph_plan", "ALEPH's M-WCHA clusters of aggregator workers"),
    "pahina": DcPlanner("netstorm.planning.dcplan:pahina_plan", "PAHInA's precision-aware assignment"),
    "eina": DcPlanner("netstorm.planning.dcplan:eina_plan", "EINA's MILP (its heuristic past the time limit)"),
}, ConfigError)

PLANNERS = DC_PLANNERS.names
"""The ``dc_planner`` option's values, in the registry's order."""
