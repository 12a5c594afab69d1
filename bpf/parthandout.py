"""The asyncio shell of ``PartWatch`` (bpf/partwatch.py): it feeds the watch from the agent's completion
hook, wakes the waiter of each tensor that got a part ready (every waiter once the iteration's collection
ended), and hands the node each part as it is ready (``GatewayRole.combine_parts``).

See docs/ARCHITECTURE.md, *The LAN tier*."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np

from bpf.agent import EdgeAgent
from bpf.partwatch import PartWatch
from bpf.tcpagent import TcpEdgeAgent
from netstorm.errors import NetStormError

Collection = asyncio.Task[list[np.ndarray] | NetStormError]
"""The task collecting an iteration's LAN sums: the sums, or why there are none."""


class PartHandout:
    """One iteration's parts for the node, from the moment the first tensor asks for them part by part."""

    def __init__(self, agent: EdgeAgent | TcpEdgeAgent, iteration: int, collection: Collection) -> None:
        """Watch ``iteration``'s LAN chunks from now on (what completed before is read at once)."""
        self.iteration = iteration
        self._collection = collection
        self._waiters: dict[int, asyncio.Event] = {}
        """tensor -> set when a part of it became ready or the iteration's collection ended."""
        agent.expect(iteration)
        self.watch = PartWatch(agent.watch(iteration, self._completed))
        collection.add_done_callback(self._finished)

    def _completed(self, seqs: np.ndarray) -> None:
        for tensor in self.watch.completed(seqs):
            event = self._waiters.get(tensor)
            if event is not None:
                event.set()

    def _finished(self, _: Collection) -> None:
        for event in self._waiters.values():
            event.set()

    async def hand(self, key: int, values: np.ndarray | None, parts: list[tuple[int, int]],
                   hand: Callable[[int, np.ndarray], None]) -> None:
        """Call ``hand(part, values)`` for each of tensor ``key``'s ``parts`` once it is ready (its LAN sum
        plus ``values`` there); the parts not handed when the collection failed raise its typed error."""
        watch = self.watch
        wake = self._waiters.setdefault(key, asyncio.Event())
        watch.follow(key, parts)
        own = None if values is None else np.asarray(values, np.float32).reshape(-1)
        handed = 0
        while handed < len(parts):
            while (part := watch.next_part(key)) is not None:
                start, stop = parts[part]
                hand(part, watch.summed(key, start, stop, own))
                handed += 1
                watch.handed_one(time.monotonic())
            if handed == len(parts):
                break
            if self._collection.done():
                outcome = self._collection.result()
                if isinstance(outcome, NetStormError):
                    raise type(outcome)(f"{outcome} ({handed} of tensor {key}'s {len(parts)} parts were handed to "
                                        f"the node before)")
                if not watch.ready(key):
                    raise RuntimeError(f"edge: iteration {self.iteration} summed but tensor {key} has parts not "
                                       f"ready")
                continue
            wake.clear()
            await wake.wait()
