"""DiLoCo with every DC simulated in one process: the reference a run over NetStorm must match.

The same schedule, outer optimizer and merge as ``sync.DiLoCo``, with the mean of the pseudo-gradients
taken here (float32, summed in DC order) instead of by the nodes' trees; only that summation order
differs, so a NetStorm run agrees with it to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from netstorm.diloco.core import GlobalState
from netstorm.diloco.outer import OuterSGD
from netstorm.diloco.schedule import Schedule

InnerStep = Callable[[int, int, np.ndarray], None]
"""inner(dc, step, local): one inner step of DC ``dc`` (0-based) on its flat parameters, in place."""


def simulate(initial: np.ndarray, dcs: int, inner: InnerStep, steps: int, schedule: Schedule,
             outer: OuterSGD | None = None, merge_alpha: float = 0.0,
             absent: Callable[[int, int], bool] | None = None) -> tuple[GlobalState, list[np.ndarray]]:
    """Run ``steps`` inner steps on ``dcs`` DCs from ``initial``; ``absent(dc, sync)`` leaves a DC out of
    a sync's mean. Returns the global state and every DC's local parameters."""
    state = GlobalState(initial, schedule, outer if outer is not None else OuterSGD())
    locals_ = [state.params.copy() for _ in range(dcs)]
    pending: dict[int, np.ndarray | None] = {}
    for step in range(1, steps + 1):
        for dc in range(dcs):
            inner(dc, step, locals_[dc])
        fragment = schedule.sent_after(step)
        if fragment is not None:
            index = schedule.sync_index(step)
            start, stop = state.bounds[fragment]
            total = np.zeros(stop - start, np.float32)
            weight = 0
            for dc in range(dcs):
                if absent is not None and absent(dc, index):
                    continue
                total += state.params[start:stop] - locals_[dc][start:stop]
                weight += 1
            pending[index] = total / np.float32(weight) if weight else None
        index_applied = schedule.applied_after(step)
        if index_applied is not None:
            mean = pending.pop(index_applied)
            fragment = schedule.fragment_of(index_applied)
            start, stop = state.bounds[fragment]
            if mean is not None:
                state.outer.step(state.params, mean, start, stop)
                state.outer_steps += 1
            for dc in range(dcs):
                state.merge(fragment, locals_[dc], merge_alpha)
    return state, locals_
