"""One iteration's LAN sums at the gateway, filled chunk by chunk from completed slots (sans-I/O: aggregates
and the shell's clock in, the sums and the chunks still missing out)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from netstorm.errors import NetStormError
from netstorm.lan.batch import copy_rows, distinct
from netstorm.lan.errors import IntegerOverflow, WireError
from netstorm.lan.fixedpoint import dequantize_rows, rescale_for
from netstorm.lan.header import Flag, Header, Kind
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import control_packet
from netstorm.lan.prefault import populated
from netstorm.lan.slots import SlotEvent
from netstorm.lan.window import ReceiveWindow


@dataclass
class IterationSums:
    """One iteration's LAN sums, filled chunk by chunk from AGG datagrams.

    Each completed slot's int32 lanes and scale are stored as they come (one row copy per datagram, or one
    fancy-indexed copy per batch of them, ``take``); the conversion to floats runs once per tensor,
    vectorised, when the iteration is complete. Which chunks are still pending is a mask over the
    model's chunk sequence numbers."""

    layout: EdgeLayout
    iteration: int
    workers: int
    job: int
    missing: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    rescaled: int = 0
    integer: bool = False
    """The lanes are exact integers at scale 0 (a compressed job's round, ``netstorm/lan/introunds.py``): an
    overflow fails the iteration (``failure``) instead of re-quantising, which would not be exact."""
    lanes_kept: bool = True
    """False where the aggregation program returns results itself (``GatewayCore.return_results_from_kernel``):
    the agent then sees only overflowed slots and slot reports, so no model-sized rows are kept."""
    failure: NetStormError | None = None
    """Why the iteration ends without sums: an integer overflow, or the node failed it (``GatewayCore.fail``)."""
    on_complete: Callable[[np.ndarray], None] | None = None
    """Called with the sequence numbers of the chunks each aggregate (or batch of them) completed, as they
    complete: how a result can leave chunk by chunk (``ResultBook.stream``)."""
    watchers: list[Callable[[np.ndarray], None]] = field(default_factory=list)
    """Called like ``on_complete``: how the gateway hands the node each part of a tensor as soon as the LAN
    chunks under it are summed (``GatewayCore.watch``)."""

    def __post_init__(self) -> None:
        self.open = np.ones(self.layout.num_chunks, bool)
        """Chunks (by sequence number) whose aggregate has not arrived."""
        self.remaining = self.layout.num_chunks
        self.highest = 0
        """One past the highest chunk completed."""
        self.gap_checked = 0
        """Chunks below this were looked at for a gap once (``NackRules.gaps``)."""
        self.cluster_nacked: dict[int, np.ndarray] = {}
        """Cluster aggregator -> when each chunk was last NACKed to it and how often (``NackRules.clusters``):
        one clock per cluster, since a chunk may be missing from several clusters at once, and NACKing one says
        nothing to another."""
        self.first_at = float("inf")
        self.done_at = float("inf")
        """When the first chunk completed and when the last did (the shell's monotonic clock; the gateway logs the LAN
        phase of each iteration from them)."""
        self.raw = (populated((self.layout.num_chunks, self.layout.lanes), np.int32) if self.lanes_kept
                    else np.zeros((0, self.layout.lanes), np.int32))
        """Each chunk's exact sum, a row written when the chunk completes and read only after (lanes past a
        tensor's end are whatever the aggregate carried there: ``result``, ``part`` and the RESULT datagrams
        leave them out), so it is not cleared first; its pages are mapped at once (``populated``), not faulted
        in chunk by chunk."""
        self.scales = np.zeros(self.layout.num_chunks, np.int64)
        self._sizes = np.asarray(self.layout.sizes, np.int64)

    @property
    def done(self) -> bool:
        return not self.remaining

    @property
    def pending(self) -> set[tuple[int, int]]:
        """(tensor, chunk) of every chunk still pending."""
        return {self.layout.locate(int(q)) for q in np.flatnonzero(self.open)}

    def is_pending(self, tensor: int, chunk: int) -> bool:
        """Whether (tensor, chunk) is a chunk of the layout whose aggregate has not arrived."""
        if not 0 <= tensor < len(self.layout.sizes) or not 0 <= chunk < self.layout.chunks[tensor]:
            return False
        return bool(self.open[self.layout.first_slot[tensor] + chunk])

    def _complete(self, seqs: np.ndarray, now: float) -> None:
        fresh = distinct(seqs[self.open[seqs]])
        if fresh.size:
            self.highest = max(self.highest, int(fresh[-1]) + 1)
        self.open[fresh] = False
        self.remaining -= int(fresh.size)
        self._stamp_progress(now)
        if self.missing:
            for q in fresh:
                self.missing.pop(self.layout.locate(int(q)), None)
        if fresh.size:
            self._notify(fresh)

    def _notify(self, seqs: np.ndarray) -> None:
        if self.on_complete is not None:
            self.on_complete(seqs)
        for watcher in self.watchers:
            watcher(seqs)

    def _stamp_progress(self, now: float) -> None:
        self.first_at = min(self.first_at, now)
        if not self.remaining:
            self.done_at = min(self.done_at, now)

    def on_agg(self, head: Header, lanes: np.ndarray, now: float) -> list[tuple[int, bytes]]:
        """Take a completed slot; an overflowed one yields RESCALE NACKs to every worker instead."""
        if not self.is_pending(head.tensor, head.chunk):
            return []
        if head.flags & Flag.OVERFLOW and self.integer:
            self.failure = IntegerOverflow(
                f"iteration {self.iteration} tensor {head.tensor} chunk {head.chunk}: the integer lanes' sum left "
                f"int32 (flagged OVERFLOW by the aggregator); integer rounds are not re-quantised")
            return []
        if head.flags & Flag.OVERFLOW:
            scale = rescale_for(head.need, self.workers)
            if scale >= head.scale:
                raise WireError(f"iteration {self.iteration} tensor {head.tensor} chunk {head.chunk}: overflow at "
                                f"scale {head.scale} but the workers' values need scale {head.need}")
            self.rescaled += 1
            nack = control_packet(Kind.NACK, job=self.job, worker=0, iteration=self.iteration, tensor=head.tensor,
                                  chunk=head.chunk, slot=head.slot, scale=scale, flags=Flag.RESCALE)
            return [(w, nack) for w in range(self.workers)]
        start, stop = self.layout.bounds(head.tensor, head.chunk)
        if head.count != stop - start or lanes.size < head.count:
            raise WireError(f"AGG for tensor {head.tensor} chunk {head.chunk} has {head.count} lanes, "
                            f"expected {stop - start}")
        row = self.layout.seq(head.tensor, head.chunk)
        self.raw[row, : head.count] = lanes[: head.count]
        self.scales[row] = head.scale
        self.open[row] = False          # one chunk: scalar updates (this runs per aggregate in userspace mode)
        self.remaining -= 1
        self._stamp_progress(now)
        self.highest = max(self.highest, int(row) + 1)
        self.missing.pop((head.tensor, head.chunk), None)
        if self.on_complete is not None or self.watchers:
            self._notify(np.array([row], np.int64))
        return []

    def take(self, heads: np.ndarray, lanes: np.ndarray, rows: np.ndarray | None = None, *,
             now: float) -> tuple[np.ndarray, int]:
        """Take many aggregates at once (``heads``: their headers, valid and without OVERFLOW; ``lanes``: int32
        lanes, one row per aggregate, or with ``rows`` the rows of a whole received batch, ``rows`` naming
        each aggregate's, so only the lanes taken are copied, once): the sequence numbers of every one naming
        a chunk of the layout with its exact lane count (completed now or before, so each is ACKed), and how
        many did not."""
        seq, known = self.layout.seqs(heads["tensor"], heads["chunk"])
        tensor = np.where(known, heads["tensor"].astype(np.int64), 0)
        chunk = heads["chunk"].astype(np.int64)
        known &= heads["count"] == np.minimum(self.layout.lanes, self._sizes[tensor] - chunk * self.layout.lanes)
        index = np.flatnonzero(known)
        seq = seq[index]
        new = self.open[seq]
        taken = seq[new]
        index = index[new]
        # lanes past a tensor's last element are padding: result() cuts them off
        copy_rows(self.raw, taken, lanes[:, : self.layout.lanes], index if rows is None else rows[index])
        self.scales[taken] = heads["scale"][index]
        self._complete(taken, now)
        return seq, int(known.size - seq.size)

    def on_event(self, event: SlotEvent) -> tuple[int, list[int]] | None:
        """A slot report (a timer's, or the program's gap rule): the chunk's sequence number and exactly the
        workers it says are missing, to NACK (None: the chunk is no longer pending)."""
        key = (event.tensor, event.chunk)
        if not self.is_pending(*key):
            return None
        self.missing[key] = event.missing
        return self.layout.seq(*key), event.missing

    def result(self) -> list[np.ndarray]:
        """Every tensor's sum: exact int32 lanes times 2**-scale, rounded once to float32 (``dequantize_rows``)."""
        out = []
        for t, size in enumerate(self.layout.sizes):
            rows = slice(self.layout.first_slot[t], self.layout.first_slot[t] + self.layout.chunks[t])
            out.append(dequantize_rows(self.raw[rows], self.scales[rows]).reshape(-1)[:size])
        return out

    def part(self, tensor: int, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of tensor ``tensor``'s sum, every chunk under them complete: exactly what
        ``result`` holds there (the same exact lanes, scaled and rounded once)."""
        lanes = self.layout.lanes
        first = self.layout.first_slot[tensor]
        rows = slice(first + start // lanes, first + -(-stop // lanes))
        if np.any(self.open[rows]):
            raise ValueError(f"iteration {self.iteration} tensor {tensor} [{start}, {stop}): a chunk is not summed")
        block = dequantize_rows(self.raw[rows], self.scales[rows])
        skip = start - (start // lanes) * lanes
        return block.reshape(-1)[skip: skip + stop - start].copy()

    def first_pending(self, n: int) -> list[tuple[int, int]]:
        """(tensor, chunk) of the first ``n`` pending chunks, in model order."""
        return [self.layout.locate(int(q)) for q in np.flatnonzero(self.open)[:n]]

    def describe_missing(self) -> str:
        shown = self.first_pending(5)
        parts = [f"tensor {t} chunk {c} missing workers {self.missing.get((t, c), 'unknown (no report yet)')}"
                 for t, c in shown]
        more = f" and {self.remaining - len(shown)} more" if self.remaining > len(shown) else ""
        return "; ".join(parts) + more


@dataclass
class Stream:
    """An iteration whose result leaves chunk by chunk (``ResultBook.stream``)."""

    sums: IterationSums
    total: int
    unicast: bool
    rows: np.ndarray
    """RESULT datagrams, one row per chunk of the model, filled as the chunks complete (PULLs are answered
    from here)."""
    sent: np.ndarray
    """Chunks whose result went out."""
    due: list[np.ndarray] = field(default_factory=list)
    """Sequence numbers completed since the last flush (one result burst per batch of datagrams)."""


class SumsBook:
    """Every iteration's sums the gateway holds: those of its receive window, opened on first use (so nothing a
    stray datagram names allocates beyond it), and the last few collected (a re-emitted aggregate of one is
    ACKed again, a REPORT about one is taken)."""

    def __init__(self, window: ReceiveWindow, *, workers: int, job: int,
                 planned: Callable[[int], tuple[EdgeLayout, bool]]) -> None:
        self.window = window
        self.workers = workers
        self.job = job
        self.planned = planned
        """iteration -> the layout it travels on and whether its lanes are exact integers."""
        self.lanes_kept = True
        """False where the program returns results itself: no model-sized rows are kept."""
        self.open: dict[int, IterationSums] = {}
        self.finished: dict[int, IterationSums] = {}
        self.collecting: set[int] = set()
        """Iterations the shell waits for: their sums stay when the window moves past them."""

    def forget_before(self, iteration: int) -> None:
        """Drop the sums of iterations older than ``iteration`` that nobody waits for."""
        for old in [k for k in self.open if k < iteration and k not in self.collecting]:
            del self.open[old]

    def accepts(self, iteration: int) -> bool:
        """Whether datagrams of ``iteration`` may create or touch its sums: only iterations of the window."""
        if iteration in self.open:
            return True
        if iteration in self.finished:
            return False
        if self.window.base is None:
            return len(self.open) < self.window.span
        return self.window.inside(iteration)

    def sums(self, iteration: int) -> IterationSums:
        """``iteration``'s sums, opened on first use."""
        sums = self.open.get(iteration)
        if sums is None:
            layout, integer = self.planned(iteration)
            sums = IterationSums(layout, iteration, self.workers, self.job, integer=integer,
                                 lanes_kept=self.lanes_kept)
            self.open[iteration] = sums
        return sums

    def watch(self, iteration: int, watcher: Callable[[np.ndarray], None]) -> IterationSums:
        """Call ``watcher`` with the sequence numbers of ``iteration``'s chunks as they complete (from now on;
        the returned sums' ``open`` mask says which completed before). ValueError outside the window."""
        if not self.accepts(iteration):
            raise ValueError(f"iteration {iteration} is outside the window the gateway receives")
        sums = self.sums(iteration)
        sums.watchers.append(watcher)
        return sums

    def collected(self, iteration: int, sums: IterationSums) -> None:
        """The shell stopped waiting for ``iteration`` (its sums taken, or it failed or timed out)."""
        self.collecting.discard(iteration)
        self.open.pop(iteration, None)
        self.finished[iteration] = sums
        for old in [k for k in self.finished if k < iteration - 4]:
            del self.finished[old]

    def summed_at(self, iteration: int) -> tuple[float, float] | None:
        """When the first and the last chunk of a collected ``iteration`` completed (the shell's clock)."""
        sums = self.finished.get(iteration)
        return None if sums is None else (sums.first_at, sums.done_at)
