"""The trainers of one DC: how their pushes and pulls become the node's one contribution stream.

A node serves ``trainers`` trainers (ranks; 1 unless configured). Each rank's push of a tensor counts:
the DC contributes the sum of every rank's values once all have pushed, and the DC's worker count says
so (it registered ``trainers`` workers, plus its LAN workers). A trainer beyond them is refused at its
``init`` at once (``TrainerLimit``), so a second process on the same node can never slip its values
into the DC's gradient.

The bookkeeping cannot lie:

- A push that fails changes no counter: it is checked whole before anything of it is recorded (finite
  values with ``check_finite``, the ``max_ahead`` window), and if handing the sum to the node fails
  before the node counted it, the rank's values are taken back out.
- A result is released at the node only after every rank has read it, so ``max_ahead`` bounds both
  the results held and how far any rank runs ahead: a rank more than ``max_ahead`` iterations ahead of
  its own oldest unpulled result is refused (``TooFarAhead``: it must pull first; waiting would
  deadlock a trainer that sends one request at a time), one ahead of the slowest rank waits for it.
- A rank that disconnects frees its slot and its values not yet summed are dropped; a replacement
  ``init`` takes the slot and continues at the node's next iteration, reading nothing older (the
  results its predecessor left unread are released once complete).

Counters are per rank and per tensor, and never behind the node's: an iteration that failed at the
node is over for every rank, whoever has not heard yet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from netstorm.errors import (
    ChunkError,
    NonFinite,
    TooFarAhead,
    TrainerLimit,
    TrainerProtocolError,
    TrainerTimeout,
)
from netstorm.layout import Layout
from node.service import GeneralNode

log = logging.getLogger("netstorm.node.trainer")


@dataclasses.dataclass
class _Rank:
    id: int
    name: str
    next_push: np.ndarray
    """Per tensor, the iteration this rank's next push belongs to (never behind the node's)."""
    next_pull: np.ndarray
    """Per tensor, the iteration this rank's next pull returns (never behind the node's)."""


class Ranks:
    """The trainers (ranks) of ``node``; see the module docstring."""

    def __init__(self, node: GeneralNode) -> None:
        self.node = node
        self._ranks: dict[int, _Rank] = {}
        self._ids = itertools.count(1)
        self._pending: dict[tuple[int, int], dict[int, np.ndarray | None]] = {}
        """(iteration, key) -> each rank's values not yet handed to the node (None: zeros)."""
        self._reads: dict[tuple[int, int], set[int]] = {}
        """(iteration, key) -> the ranks that read its sum, until every rank has."""
        self._flushing: set[int] = set()
        self._progress = asyncio.Event()
        self.initialized = False
        """An init round completed here: later inits are replacements and run no round of their own."""
        self._init_source: int | None = None

    @property
    def slots(self) -> int:
        return self.node.trainers

    def __len__(self) -> int:
        return len(self._ranks)

    # ---- joining and leaving ------------------------------------------------------------------------

    def join(self, name: str) -> int:
        """A trainer's ``init``: its rank id, or TrainerLimit at once when every slot is taken."""
        if len(self._ranks) >= self.slots:
            raise TrainerLimit(f"node {self.node.node_id} already serves {len(self._ranks)} trainer(s), as many "
                               f"as it is configured for (trainers = {self.slots}); {name} is refused")
        rank = _Rank(next(self._ids), name, np.zeros(0, np.int64), np.zeros(0, np.int64))
        self._ranks[rank.id] = rank
        return rank.id

    def start(self, rank_id: int, layout: Layout, *, replacement: bool) -> None:
        """Counters of a rank that joined: from the node's next iteration on. A replacement reads
        nothing older: the results between the node's oldest unpulled and its next are marked read."""
        rank = self._ranks[rank_id]
        core = self.node.core
        n = len(layout.tensors)
        rank.next_push = np.array([core.key_next(k) for k in range(n)], dtype=np.int64)
        if not replacement:
            rank.next_pull = np.array([core.pull_iteration(k) for k in range(n)], dtype=np.int64)
            return
        # A predecessor that died in the middle of a push left some tensors an iteration behind: that
        # iteration lacks part of this DC's gradient and can only fail (at its timeout, everywhere); the
        # replacement starts after it for every tensor.
        rank.next_push[:] = int(rank.next_push.max(initial=0))
        rank.next_pull = rank.next_push.copy()
        for key in range(n):
            for iteration in range(core.pull_iteration(key), core.key_next(key)):
                self._reads.setdefault((iteration, key), set()).add(rank_id)

    async def settle(self, layout: Layout) -> None:
        """Release every result all ranks have read, waiting for those not complete yet (what a departed
        rank left unread); an iteration that fails meanwhile is over anyway."""
        keys = list(range(len(layout.tensors)))
        core = self.node.core
        while True:
            whole = min(core.key_next(k) for k in keys)  # iterations before it hold this DC's whole gradient
            waiting = [k for k in keys if self._all_read(core.pull_iteration(k), k)
                       and core.pull_iteration(k) < whole]
            if not waiting:
                return
            iteration = min(core.pull_iteration(k) for k in waiting)
            try:
                await self.node.wait_keys(iteration, [k for k in waiting if core.pull_iteration(k) == iteration])
            except Exception as exc:  # a failed iteration is skipped by the node: nothing to release
                log.info("node %d: iteration %d left unread by a departed trainer ended: %s", self.node.node_id,
                         iteration, exc)
            for key in waiting:
                self._release(key)

    def leave(self, rank_id: int | None) -> None:
        """A trainer disconnected (or its init failed): its slot is free, its unsummed values dropped."""
        if rank_id is None or self._ranks.pop(rank_id, None) is None:
            return
        for entry in self._pending.values():
            entry.pop(rank_id, None)
        for readers in self._reads.values():
            readers.discard(rank_id)
        if self._init_source == rank_id and not self.initialized:
            self._init_source = None
        layout = self.node.layout
        if layout is not None:
            for key in range(len(layout.tensors)):
                self._release(key)
        self._wake()

    # ---- counters -----------------------------------------------------------------------------------

    def push_iteration(self, rank_id: int, key: int) -> int:
        return max(int(self._ranks[rank_id].next_push[key]), self.node.core.key_next(key))

    def pull_iteration(self, rank_id: int, key: int) -> int:
        return max(int(self._ranks[rank_id].next_pull[key]), self.node.core.pull_iteration(key))

    # ---- pushes -------------------------------------------------------------------------------------

    async def push(self, rank_id: int, layout: Layout, values: Mapping[int, np.ndarray | None]) -> int:
        """This rank's values for tensors ``values`` (None: zeros), each in its next iteration; returns
        the last one. Checked whole first; a refused push changes no counter."""
        config = self.node.config
        rank = self._ranks[rank_id]
        targets: dict[int, int] = {}
        for key, value in values.items():
            name = layout.tensors[key].name
            if config.check_finite and value is not None and not bool(np.isfinite(value).all()):
                raise NonFinite(f"DC {self.node.node_id}: tensor {name!r} holds NaN or Inf; nothing of this push "
                                f"from {rank.name} was counted")
            iteration = self.push_iteration(rank_id, key)
            own = self.pull_iteration(rank_id, key)
            if iteration - own > config.max_ahead:
                raise TooFarAhead(f"DC {self.node.node_id}: tensor {name!r} pushed for iteration {iteration}, but "
                                  f"{rank.name} has not pulled iteration {own} (max_ahead = {config.max_ahead}); "
                                  f"pull first")
            targets[key] = iteration
        for key, iteration in targets.items():  # the slowest rank's pulls: wait for them
            def pulled(k: int = key, i: int = iteration) -> bool:
                return i - self.node.core.pull_iteration(k) <= config.max_ahead
            await self._wait(pulled, f"{rank.name}'s push of iteration {iteration} waits for the node's other "
                                     f"trainers to pull iteration {iteration - config.max_ahead}")
        copy = self.slots > 1  # held until every rank pushed: the trainer may reuse its buffer meanwhile
        last = -1
        for key, iteration in targets.items():
            iteration = max(iteration, self.push_iteration(rank_id, key))
            value = values[key]
            self._pending.setdefault((iteration, key), {})[rank_id] = (
                value.copy() if copy and value is not None else value)
            rank.next_push[key] = iteration + 1
            try:
                await self._flush(key)
            except BaseException:
                if self.node.core.key_next(key) <= iteration:  # the node did not count it: take it back
                    entry = self._pending.get((iteration, key))
                    if entry is not None:
                        entry.pop(rank_id, None)
                    rank.next_push[key] = iteration
                raise
            last = iteration
        return last

    async def _flush(self, key: int) -> None:
        """Hand the node every complete sum of ``key``, oldest first (one flush per tensor at a time)."""
        if key in self._flushing:
            return
        self._flushing.add(key)
        try:
            core = self.node.core
            while True:
                iteration = core.key_next(key)
                for stale in [ik for ik in self._pending if ik[1] == key and ik[0] < iteration]:
                    del self._pending[stale]  # an iteration the node skipped (it failed)
                entry = self._pending.get((iteration, key))
                if entry is None or len(entry) < self.slots:
                    return
                total: np.ndarray | None = None
                for value in entry.values():
                    if value is not None:
                        total = value if total is None else total + value
                try:
                    await self.node.contribute(key, total, iteration=iteration)
                except BaseException:
                    if core.key_next(key) > iteration:  # counted, or the iteration is over: drop it
                        self._pending.pop((iteration, key), None)
                    raise
                self._pending.pop((iteration, key), None)
        finally:
            self._flushing.discard(key)

    # ---- pulls --------------------------------------------------------------------------------------

    async def pull(self, rank_id: int, layout: Layout, keys: Sequence[int],
                   sink: Callable[[int, np.ndarray], None]) -> int:
        """Wait for the oldest iteration of ``keys`` this rank has not read; ``sink(key, sum)`` reads each."""
        if not keys:
            return -1
        iterations = {self.pull_iteration(rank_id, k) for k in keys}
        if len(iterations) != 1:
            raise ChunkError(f"tensors pulled together are at different iterations {sorted(iterations)}")
        iteration = iterations.pop()
        for key in keys:
            if iteration >= self.push_iteration(rank_id, key):
                raise ChunkError(f"tensor {layout.tensors[key].name!r} pulled before it was pushed "
                                 f"(iteration {iteration})")
        for key in keys:  # sums held back while an earlier iteration was still open at the node
            await self._flush(key)
        await self.node.wait_keys(iteration, keys)
        result = self.node.core.result(iteration)
        rank = self._ranks[rank_id]
        for key in keys:
            sink(key, result[layout.key_slice(key)])
            rank.next_pull[key] = iteration + 1
            self._reads.setdefault((iteration, key), set()).add(rank_id)
        for key in keys:
            self._release(key)
        return iteration

    def _all_read(self, iteration: int, key: int) -> bool:
        return set(self._ranks) <= self._reads.get((iteration, key), set())

    def _release(self, key: int) -> None:
        """Release ``key``'s results, oldest first, while every rank has read them."""
        core = self.node.core
        released = False
        while True:
            iteration = core.pull_iteration(key)
            for stale in [ik for ik in self._reads if ik[1] == key and ik[0] < iteration]:
                del self._reads[stale]
            if iteration >= core.key_next(key) or not self._all_read(iteration, key) \
                    or not core.keys_ready(iteration, [key]) or core.failure(iteration) is not None:
                break
            self._reads.pop((iteration, key), None)
            self.node.release(iteration, key)
            released = True
        if released:
            self._wake()

    # ---- waiting ------------------------------------------------------------------------------------

    def _wake(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()

    async def _wait(self, ready: Callable[[], bool], what: str) -> None:
        timeout = self.node.config.iteration_timeout
        try:
            async with asyncio.timeout(timeout):
                while not ready():
                    await self._progress.wait()
        except TimeoutError:
            raise TrainerTimeout(f"node {self.node.node_id}: {what}; none came within {timeout:g} s") from None

    def init_values(self, rank_id: int, first: bool) -> bool:
        """Whether this rank's values are the DC's in the init round (``first``: this node contributes
        the initial values): one rank's, never their sum."""
        if not first:
            return False
        if self._init_source is None:
            self._init_source = rank_id
        return self._init_source == rank_id

    def check_request(self, rank_id: int | None) -> int:
        if rank_id is None or rank_id not in self._ranks:
            raise TrainerProtocolError("no init on this connection: call init first")
        return rank_id
