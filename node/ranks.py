"""The trainers of one DC: how their pushes and pulls become the node's one contribution stream.

See docs/ARCHITECTURE.md, *The node: data plane, trainers, back-pressure*."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

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
from node import pieces
from node.core import NodeCore
from node.service import GeneralNode

log = logging.getLogger("netstorm.node.trainer")

BATCH = 2048
"""Tensors of one push handed to the node between turns of the event loop."""


@dataclasses.dataclass
class _Rank:
    id: int
    name: str
    next_push: list[int]
    """Per tensor, the iteration this rank's next push belongs to (never behind the node's)."""
    next_pull: list[int]
    """Per tensor, the iteration this rank's next pull returns (never behind the node's)."""


class RankBook:
    """The ranks of one node and their counters, against the node's ``NodeCore``; no I/O."""

    def __init__(self, node_id: int, core: NodeCore, slots: int) -> None:
        self.node_id = node_id
        self.core = core
        self.slots = slots
        self._ranks: dict[int, _Rank] = {}
        self._ids = itertools.count(1)
        self._pending: dict[int, dict[int, dict[int, np.ndarray | None]]] = {}
        """key -> iteration -> each rank's values not yet handed to the node (None: zeros). Per key, so
        that what one tensor does never scans another's: a push of n tensors costs O(n), not O(n²)."""
        self._reads: dict[int, dict[int, set[int]]] = {}
        """key -> iteration -> the ranks that read its sum, until every rank has."""
        self.initialized = False
        """An init round completed here: later inits are replacements and run no round of their own."""
        self._init_source: int | None = None

    def __len__(self) -> int:
        return len(self._ranks)

    def name(self, rank_id: int) -> str:
        return self._ranks[rank_id].name

    def has(self, rank_id: int) -> bool:
        return rank_id in self._ranks

    # ---- joining and leaving ------------------------------------------------------------------------

    def join(self, name: str) -> int:
        """A trainer's ``init``: its rank id, or TrainerLimit at once when every slot is taken."""
        if len(self._ranks) >= self.slots:
            raise TrainerLimit(f"node {self.node_id} already serves {len(self._ranks)} trainer(s), as many as it "
                               f"is configured for (trainers = {self.slots}); {name} is refused")
        rank = _Rank(next(self._ids), name, [], [])
        self._ranks[rank.id] = rank
        return rank.id

    def start(self, rank_id: int, keys: int, *, replacement: bool) -> None:
        """Counters of a rank that joined: from the node's next iteration on. A replacement reads
        nothing older: the results between the node's oldest unpulled and its next are marked read."""
        rank = self._ranks[rank_id]
        core = self.core
        rank.next_push = [core.key_next(k) for k in range(keys)]
        if not replacement:
            rank.next_pull = [core.pull_iteration(k) for k in range(keys)]
            return
        # A predecessor that died in the middle of a push left some tensors an iteration behind: that
        # iteration lacks part of this DC's gradient and fails (at once, everywhere, when the place
        # emptied); the replacement starts after it for every tensor.
        rank.next_push = [max(rank.next_push, default=0)] * keys
        rank.next_pull = list(rank.next_push)
        for key in range(keys):
            for iteration in range(core.pull_iteration(key), core.key_next(key)):
                self._reads.setdefault(key, {}).setdefault(iteration, set()).add(rank_id)

    def unread(self, keys: int) -> tuple[int, list[int]] | None:
        """The oldest iteration every rank has read (or was excused from) but the node still holds, and
        its tensors: what a departed rank left unread. Only iterations holding this DC's whole
        contribution; None when there is none."""
        core = self.core
        whole = min(core.key_next(k) for k in range(keys))
        waiting = [k for k in range(keys) if core.pull_iteration(k) < whole
                   and self._all_read(core.pull_iteration(k), k)]
        if not waiting:
            return None
        iteration = min(core.pull_iteration(k) for k in waiting)
        return iteration, [k for k in waiting if core.pull_iteration(k) == iteration]

    def leave(self, rank_id: int | None, keys: int) -> list[tuple[int, int]]:
        """A trainer disconnected (or its init failed): its slot is free, its unsummed values dropped.
        Returns the (iteration, key) sums to release now that it no longer reads."""
        if rank_id is None or self._ranks.pop(rank_id, None) is None:
            return []
        for by_iteration in self._pending.values():
            for entry in by_iteration.values():
                entry.pop(rank_id, None)
        for by_iteration_read in self._reads.values():
            for readers in by_iteration_read.values():
                readers.discard(rank_id)
        if self._init_source == rank_id and not self.initialized:
            self._init_source = None
        return [release for key in range(keys) for release in self.releasable(key)]

    @property
    def vacant(self) -> bool:
        """A place is empty after the init round: this DC's sum cannot be made until a replacement inits
        (the node core then fails each of its iterations as soon as it is under way anywhere)."""
        return self.initialized and len(self._ranks) < self.slots

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

    # ---- counters -----------------------------------------------------------------------------------

    def push_iteration(self, rank_id: int, key: int) -> int:
        return max(self._ranks[rank_id].next_push[key], self.core.key_next(key))

    def pull_iteration(self, rank_id: int, key: int) -> int:
        return max(self._ranks[rank_id].next_pull[key], self.core.pull_iteration(key))

    # ---- pushes -------------------------------------------------------------------------------------

    def missed(self, rank_id: int, keys: Iterable[int]) -> int | None:
        """The oldest iteration that failed at the node before this rank pushed into it (its trainer still
        counts it as its next): that push is answered with the failure, so a trainer slower than a peer's
        death learns of it at once, as one that had pushed does, instead of silently landing in the next
        iteration and waiting there. Its counters pass over it (``pass_over``)."""
        rank = self._ranks[rank_id]
        for key in keys:
            own = rank.next_push[key]
            if own < self.core.key_next(key) and self.core.failure(own) is not None:
                return own
        return None

    def pass_over(self, rank_id: int, iteration: int) -> None:
        """This rank has been told ``iteration`` failed: its next push and pull of every tensor are past it."""
        rank = self._ranks[rank_id]
        for key in range(len(rank.next_push)):
            rank.next_push[key] = max(rank.next_push[key], iteration + 1)
            rank.next_pull[key] = max(rank.next_pull[key], iteration + 1)

    def check_push(self, rank_id: int, layout: Layout, values: Mapping[int, np.ndarray | None]) -> dict[int, int]:
        """The iteration each tensor of a push belongs to, checked whole before anything is recorded:
        NonFinite (with ``check_finite``), TooFarAhead past the rank's own oldest unpulled result."""
        config = self.core.config
        rank = self._ranks[rank_id]
        targets: dict[int, int] = {}
        for key, value in values.items():
            name = layout.tensors[key].name
            if config.check_finite and value is not None and not bool(np.isfinite(value).all()):
                raise NonFinite(f"DC {self.node_id}: tensor {name!r} holds NaN or Inf; nothing of this push from "
                                f"{rank.name} was counted")
            iteration = self.push_iteration(rank_id, key)
            own = self.pull_iteration(rank_id, key)
            if iteration - own > config.max_ahead:
                raise TooFarAhead(f"DC {self.node_id}: tensor {name!r} pushed for iteration {iteration}, but "
                                  f"{rank.name} has not pulled iteration {own} (max_ahead = {config.max_ahead}); "
                                  f"pull first")
            targets[key] = iteration
        return targets

    def blocked(self, key: int, iteration: int) -> bool:
        """A push of ``key`` for ``iteration`` runs more than ``max_ahead`` past the slowest rank's pull."""
        return iteration - self.core.pull_iteration(key) > self.core.config.max_ahead

    def record(self, rank_id: int, key: int, value: np.ndarray | None) -> int:
        """This rank's values of ``key`` join their iteration's sum (copied when other ranks are still
        to push: the trainer may reuse its buffer); returns the iteration."""
        iteration = self.push_iteration(rank_id, key)
        held = value.copy() if self.slots > 1 and value is not None else value
        self._pending.setdefault(key, {}).setdefault(iteration, {})[rank_id] = held
        self._ranks[rank_id].next_push[key] = iteration + 1
        return iteration

    def take_back(self, rank_id: int, key: int, iteration: int) -> None:
        """Handing the sum to the node failed before it counted: the rank's values leave it, its counter
        goes back (the iteration, if it failed at the node, is over for everyone anyway)."""
        if self.core.key_next(key) > iteration:
            return
        entry = self._pending.get(key, {}).get(iteration)
        if entry is not None:
            entry.pop(rank_id, None)
        self._ranks[rank_id].next_push[key] = iteration

    def ready(self, key: int) -> tuple[int, np.ndarray | None] | None:
        """The next sum of ``key`` to hand the node: its iteration is the node's next for ``key`` and
        every rank pushed (None: values only, zeros). None while some rank has still to push."""
        iteration = self.core.key_next(key)
        by_iteration = self._pending.get(key)
        if by_iteration is None:
            return None
        for stale in [i for i in by_iteration if i < iteration]:
            del by_iteration[stale]  # an iteration the node skipped (it failed)
        entry = by_iteration.get(iteration)
        if entry is None or len(entry) < self.slots:
            return None
        total: np.ndarray | None = None
        for value in entry.values():
            if value is not None:
                total = value if total is None else total + value
        return iteration, total

    def handed(self, key: int, iteration: int) -> None:
        """The node took (or is over with) ``iteration``'s sum of ``key``."""
        if self.core.key_next(key) > iteration:
            by_iteration = self._pending.get(key)
            if by_iteration is not None:
                by_iteration.pop(iteration, None)
                if not by_iteration:
                    del self._pending[key]

    # ---- pulls --------------------------------------------------------------------------------------

    def pull_target(self, rank_id: int, layout: Layout, keys: Sequence[int]) -> int:
        """The iteration a pull of ``keys`` returns: the oldest this rank has not read, the same for all."""
        iterations = {self.pull_iteration(rank_id, k) for k in keys}
        if len(iterations) != 1:
            raise ChunkError(f"tensors pulled together are at different iterations {sorted(iterations)}")
        iteration = iterations.pop()
        for key in keys:
            if iteration >= self.push_iteration(rank_id, key):
                raise ChunkError(f"tensor {layout.tensors[key].name!r} pulled before it was pushed "
                                 f"(iteration {iteration})")
        return iteration

    def read(self, rank_id: int, iteration: int, keys: Sequence[int]) -> list[tuple[int, int]]:
        """The rank read ``keys``' sums of ``iteration``; returns the (iteration, key) sums to release."""
        rank = self._ranks[rank_id]
        for key in keys:
            rank.next_pull[key] = iteration + 1
            self._reads.setdefault(key, {}).setdefault(iteration, set()).add(rank_id)
        return [release for key in keys for release in self.releasable(key)]

    def releasable(self, key: int) -> list[tuple[int, int]]:
        """``key``'s sums every rank has read and the node holds complete, oldest first; each is taken
        as released (the caller releases them at the node in this order)."""
        core = self.core
        out: list[tuple[int, int]] = []
        iteration = core.pull_iteration(key)
        reads = self._reads.get(key, {})
        for stale in [i for i in reads if i < iteration]:
            del reads[stale]
        while iteration < core.key_next(key) and self._all_read(iteration, key) \
                and core.failure(iteration) is None and core.keys_ready(iteration, [key]):
            reads.pop(iteration, None)
            out.append((iteration, key))
            iteration += 1
        if not reads:
            self._reads.pop(key, None)
        return out

    def _all_read(self, iteration: int, key: int) -> bool:
        readers = self._reads.get(key, {}).get(iteration, set())
        return len(readers) >= len(self._ranks) and set(self._ranks) <= readers


class Ranks:
    """The asyncio shell of ``RankBook`` in the trainer endpoint: it awaits the node."""

    def __init__(self, node: GeneralNode) -> None:
        self.node = node
        self.book = RankBook(node.node_id, node.core, node.trainers)
        self._flushing: set[int] = set()
        self._progress = asyncio.Event()

    def __len__(self) -> int:
        return len(self.book)

    @property
    def initialized(self) -> bool:
        return self.book.initialized

    @initialized.setter
    def initialized(self, value: bool) -> None:
        self.book.initialized = value

    def join(self, name: str) -> int:
        return self.book.join(name)

    def start(self, rank_id: int, layout: Layout, *, replacement: bool) -> None:
        self.book.start(rank_id, len(layout.tensors), replacement=replacement)
        if replacement and not self.book.vacant:
            self.node.fill()

    def init_values(self, rank_id: int, first: bool) -> bool:
        return self.book.init_values(rank_id, first)

    def check_request(self, rank_id: int | None) -> int:
        return self.book.check_request(rank_id)

    def push_iteration(self, rank_id: int, key: int) -> int:
        return self.book.push_iteration(rank_id, key)

    def pull_iteration(self, rank_id: int, key: int) -> int:
        return self.book.pull_iteration(rank_id, key)

    def leave(self, rank_id: int | None, *, clean: bool = False) -> None:
        """A rank's connection ended; ``clean``: it said Bye (its job is over), so only an iteration already
        under way fails, and the next waits for a replacement."""
        layout = self.node.layout
        present = rank_id is not None and self.book.has(rank_id)
        self._release(self.book.leave(rank_id, len(layout.tensors) if layout is not None else 0))
        self._wake()
        if present and layout is not None and self.book.vacant:
            how = "closed" if clean else "closed or died"
            self.node.vacate(f"node {self.node.node_id}'s trainer {how}, and no replacement has inited", clean=clean)

    async def settle(self, layout: Layout) -> None:
        """Release every result all ranks have read, waiting for those not complete yet (what a departed
        rank left unread); an iteration that fails meanwhile is over anyway."""
        keys = len(layout.tensors)
        while (unread := self.book.unread(keys)) is not None:
            iteration, waiting = unread
            try:
                await self.node.wait_keys(iteration, waiting)
            except Exception as exc:  # a failed iteration is skipped by the node: nothing to release
                log.info("node %d: iteration %d left unread by a departed trainer ended: %s", self.node.node_id,
                         iteration, exc)
            self._release([r for key in waiting for r in self.book.releasable(key)])

    async def push(self, rank_id: int, layout: Layout, values: Mapping[int, np.ndarray | None]) -> int:
        """This rank's values for tensors ``values`` (None: zeros), each in its next iteration; returns
        the last one. Checked whole first; a refused push changes no counter."""
        book = self.book
        missed = book.missed(rank_id, values)
        if missed is not None:
            book.pass_over(rank_id, missed)
            self.node.check(missed)  # raises the failure, typed by its cause
        targets = book.check_push(rank_id, layout, values)
        max_ahead = self.node.config.max_ahead
        for key, iteration in targets.items():  # the slowest rank's pulls: wait for them
            if not book.blocked(key, iteration):
                continue

            def pulled(k: int = key, i: int = iteration) -> bool:
                return not book.blocked(k, i)
            await self._wait(pulled, f"{book.name(rank_id)}'s push of iteration {iteration} waits for the node's "
                                     f"other trainers to pull iteration {iteration - max_ahead}")
        recorded = {key: book.record(rank_id, key, values[key]) for key in targets}
        try:
            await self._flush_many(list(recorded))
        except BaseException:
            for key, iteration in recorded.items():  # those the node did not count leave the sum
                book.take_back(rank_id, key, iteration)
            raise
        return max(recorded.values(), default=-1)

    async def _flush_many(self, keys: Sequence[int]) -> None:
        """Hand the node every complete sum of ``keys``, oldest first, in batches of ``BATCH`` tensors with a
        turn of the event loop between them (heartbeats and peers' frames go on during a large push)."""
        mine = [key for key in keys if key not in self._flushing]
        self._flushing.update(mine)
        try:
            while True:
                groups: dict[int, list[tuple[int, np.ndarray | None]]] = {}
                for key in mine:
                    ready = self.book.ready(key)
                    if ready is not None:
                        groups.setdefault(ready[0], []).append((key, ready[1]))
                if not groups:
                    return
                for iteration in sorted(groups):
                    items = groups[iteration]
                    for start in range(0, len(items), BATCH):
                        batch = items[start:start + BATCH]
                        try:
                            await self.node.contribute_many(iteration, batch)
                        finally:
                            for key, _ in batch:
                                self.book.handed(key, iteration)
                        if start + BATCH < len(items):
                            await asyncio.sleep(0)
        finally:
            self._flushing.difference_update(mine)

    async def pull(self, rank_id: int, layout: Layout, keys: Sequence[int],
                   sink: Callable[[int, int, np.ndarray], None]) -> int:
        """Wait for the oldest iteration of ``keys`` this rank has not read; ``sink(key, start, piece)`` reads
        each tensor's sum in pieces (elements ``start`` on) of at most ``pieces.PIECE`` elements, with a turn
        of the loop between them, so a model-sized pull does not hold the node's heartbeat back."""
        if not keys:
            return -1
        iteration = self.book.pull_target(rank_id, layout, keys)
        await self._flush_many(keys)  # sums held back while an earlier iteration was still open at the node
        stats = getattr(self.node, "stats", None)
        if stats is not None and not self.node.core.keys_ready(iteration, keys):
            loop = asyncio.get_running_loop()
            began = loop.time()
            try:
                await self.node.wait_keys(iteration, keys)
            finally:
                stats.trainer_waits += 1
                stats.trainer_wait_s += loop.time() - began
        else:
            await self.node.wait_keys(iteration, keys)
        result = self.node.core.result(iteration)
        copied = 0  # elements since the last turn of the loop: many small tensors share a piece
        for key in keys:
            span = layout.key_slice(key)
            for start, stop in pieces.spans(span.stop - span.start):
                if copied and copied + stop - start > pieces.PIECE:
                    await pieces.turn()
                    copied = 0
                sink(key, start, result[span.start + start:span.start + stop])
                copied += stop - start
        self._release(self.book.read(rank_id, iteration, keys))
        return iteration

    def _release(self, releases: list[tuple[int, int]]) -> None:
        for iteration, key in releases:
            self.node.release(iteration, key)
        if releases:
            self._wake()

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
