"""A small builder over one HiGHS model (highspy) for the LAN planners' linear and mixed-integer programs.

EINA's routing model, its rate LPs for fixed trees, GRID's relaxation and PAHInA's Stage 2 cross-check
are each a few hundred rows built from named variables; this keeps their construction readable and
their solves bounded (``time_limit``) and quiet.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import highspy

INF = highspy.kHighsInf


@dataclass(frozen=True)
class Result:
    status: str
    """``optimal``, ``time limit`` (with or without an incumbent), ``infeasible`` or HiGHS's word."""
    values: list[float] | None
    """Column values of the best solution found (None without one)."""
    objective: float
    seconds: float
    gap: float
    """Relative MIP gap at the end (0 when proven optimal or for an LP)."""

    @property
    def has_solution(self) -> bool:
        return self.values is not None


class Model:
    def __init__(self, *, maximize: bool = True) -> None:
        self.highs = highspy.Highs()
        self.highs.setOptionValue("output_flag", False)
        self.highs.setOptionValue("threads", 1)
        self.maximize = maximize
        self.columns = 0
        self.integer: list[int] = []

    def var(self, lb: float = 0.0, ub: float = INF, cost: float = 0.0, *, integer: bool = False) -> int:
        self.highs.addCol(cost, lb, ub, 0, [], [])
        index = self.columns
        self.columns += 1
        if integer:
            self.integer.append(index)
        return index

    def row(self, terms: Iterable[tuple[int, float]], lb: float = -INF, ub: float = INF) -> None:
        merged: dict[int, float] = {}
        for col, coef in terms:
            merged[col] = merged.get(col, 0.0) + coef
        cols = [c for c, v in merged.items() if v != 0.0]
        self.highs.addRow(lb, ub, len(cols), cols, [merged[c] for c in cols])

    def solve(self, *, time_limit: float | None = None) -> Result:
        for col in self.integer:
            self.highs.changeColIntegrality(col, highspy.HighsVarType.kInteger)
        if self.maximize:
            self.highs.changeObjectiveSense(highspy.ObjSense.kMaximize)
        if time_limit is not None:
            self.highs.setOptionValue("time_limit", float(max(time_limit, 0.01)))
        start = time.perf_counter()
        self.highs.run()
        seconds = time.perf_counter() - start
        status = self.highs.getModelStatus()
        info = self.highs.getInfo()
        has = info.primal_solution_status == 2  # kSolutionStatusFeasible
        values = list(self.highs.getSolution().col_value) if has else None
        gap = float(info.mip_gap) if self.integer and has and math.isfinite(info.mip_gap) else 0.0
        if status == highspy.HighsModelStatus.kOptimal:
            word = "optimal"
        elif status == highspy.HighsModelStatus.kTimeLimit:
            word = "time limit"
        elif status == highspy.HighsModelStatus.kInfeasible:
            word = "infeasible"
        else:
            word = self.highs.modelStatusToString(status).lower()
        objective = float(info.objective_function_value) if has else math.nan
        return Result(word, values, objective, seconds, gap if word != "optimal" else 0.0)
