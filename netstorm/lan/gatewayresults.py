"""The LAN gateway's results: each iteration's planned wire, the RESULT datagrams it sends (once to the
multicast group, or a copy per worker), those kept to answer PULLs, and results streamed chunk by chunk as
the chunks complete (sans-I/O: sums in, datagrams into the outbox)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from netstorm.lan.batch import distinct
from netstorm.lan.gatewayroster import GatewayRoster
from netstorm.lan.header import HEADER_BYTES, OFFSETS, Precision
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import chunk_results_into, result_packets, set_epoch, with_token
from netstorm.lan.prefault import populated
from netstorm.lan.resultwire import ResultWire
from netstorm.lan.sums import IterationSums, Stream

KEEP_RESULTS = 4
"""Iterations whose result datagrams are kept for PULLs after the newest."""


def trimmed(rows: np.ndarray, precision: Precision) -> tuple[np.ndarray, np.ndarray]:
    """One tensor's RESULT datagrams as (every chunk but the last, the last without its padding lanes):
    a datagram needs only ``count`` lanes, and a result's last chunk is often short (a bitmap of a few
    dozen bytes in a lane width of a thousand)."""
    count = int(rows[-1, OFFSETS["count"]: OFFSETS["count"] + 2].view("<u2")[0])
    return rows[:-1], np.ascontiguousarray(rows[-1:, : HEADER_BYTES + count * precision.lane_bytes])


class ResultBook:
    """Results sent, kept and streamed, per iteration."""

    def __init__(self, roster: GatewayRoster, layout: EdgeLayout) -> None:
        self.roster = roster
        self.layout = layout
        self.wires: dict[int, tuple[EdgeLayout, bool, ResultWire]] = {}
        """iteration -> its own layout, whether its lanes are exact integers, and how its result goes back,
        where one was planned."""
        self.kept: dict[int, tuple[EdgeLayout, list[np.ndarray]]] = {}
        """iteration -> its result's chunk layout and each tensor's RESULT datagrams (kept for PULLs), two
        blocks per tensor: its chunks but the last, then its last (``trimmed``)."""
        self.streams: dict[int, Stream] = {}
        """Iterations whose result is the LAN's own sum, sent chunk by chunk as the chunks complete."""
        self.streamed_chunks = 0
        """Result chunks sent before their iteration was complete (``stream``)."""

    def plan(self, iteration: int, layout: EdgeLayout, *, integer: bool, back: ResultWire | None) -> None:
        """Iteration ``iteration`` travels on ``layout`` and its result goes back as ``back`` says (None:
        float32 lanes on ``layout``). Its lanes and pool must fit the aggregator loaded for the model's."""
        if layout.lanes != self.layout.lanes or layout.num_slots > self.layout.num_slots:
            raise ValueError(f"iteration {iteration}: a layout of {layout.lanes} lanes and {layout.num_slots} slots "
                             f"does not fit the aggregator's {self.layout.lanes} lanes and {self.layout.num_slots}")
        self.wires[iteration] = (layout, integer, ResultWire.float32(layout) if back is None else back)
        for old in [k for k in self.wires if k < iteration - 8]:
            del self.wires[old]

    def planned(self, iteration: int) -> tuple[EdgeLayout, bool]:
        """The layout ``iteration`` travels on and whether its lanes are exact integers."""
        planned = self.wires.get(iteration)
        return (self.layout, False) if planned is None else (planned[0], planned[1])

    def layout_of(self, iteration: int) -> EdgeLayout:
        """The layout ``iteration`` travels on: its planned one, else the model's."""
        return self.planned(iteration)[0]

    def result_wire(self, iteration: int) -> ResultWire:
        """How ``iteration``'s result goes back: as planned, else float32 lanes on its layout."""
        planned = self.wires.get(iteration)
        return ResultWire.float32(self.layout) if planned is None else planned[2]

    def send(self, iteration: int, results: Sequence[np.ndarray], *, total: int, unicast: bool) -> None:
        """Queue the result of each chunk, a sum over ``total`` workers, in the iteration's planned wire, and
        keep it for PULLs; WireError if a result does not fit its planned format."""
        back = self.result_wire(iteration)
        blocks: list[np.ndarray] = []
        for t, r in enumerate(results):
            precision, lanes = back.encode(t, np.asarray(r))
            rows = result_packets(back.layout, job=self.roster.job, iteration=iteration, tensor=t, values=lanes,
                                  total=total, precision=precision)
            # a tensor's datagrams share one width (the next tensor's may differ); its last, often short,
            # chunk goes without the padding lanes
            blocks.extend(trimmed(set_epoch(rows, self.roster.epoch), precision))
        self.keep(iteration, back.layout, blocks)
        self.queue(iteration, blocks, unicast=unicast)

    def stream(self, iteration: int, sums: IterationSums, *, total: int, unicast: bool) -> None:
        """From now on each chunk of ``iteration`` leaves as soon as it completes (``flush``); chunks completed
        before go at once. Float32 results only."""
        if iteration in self.streams:
            return
        if self.result_wire(iteration) != ResultWire.float32(self.layout_of(iteration)):
            raise ValueError(f"iteration {iteration} has a planned result form other than float32 lanes")
        layout = sums.layout
        # a row is written when its chunk's result is sent, and read only after (``sent``)
        rows = populated((layout.num_chunks, HEADER_BYTES + 4 * layout.lanes), np.uint8)
        stream = Stream(sums, total, unicast, rows=rows, sent=np.zeros(layout.num_chunks, bool))
        self.streams[iteration] = stream
        sums.on_complete = stream.due.append
        done = np.flatnonzero(~sums.open)
        if done.size:
            stream.due.append(done)
            self.flush()

    def flush(self) -> None:
        """Send the results of the chunks completed since the last flush, for every streamed iteration."""
        for iteration, stream in self.streams.items():
            if not stream.due:
                continue
            seqs = distinct(np.concatenate(stream.due))
            stream.due.clear()
            seqs = seqs[~stream.sent[seqs]]
            if not seqs.size:
                continue
            sums = stream.sums
            # built in place in the rows kept for PULLs, one run of consecutive chunks at a time (one or a few
            # per batch: aggregates complete about in model order); those views are what the outbox sends
            blocks = chunk_results_into(stream.rows, sums.layout, job=self.roster.job, iteration=iteration,
                                        seqs=seqs, raw=sums.raw, scales=sums.scales, total=stream.total)
            for block in blocks:
                set_epoch(block, self.roster.epoch)
            stream.sent[seqs] = True
            if not sums.done:
                self.streamed_chunks += int(seqs.size)
            self.queue(iteration, blocks, unicast=stream.unicast)

    def finish(self, iteration: int) -> None:
        """Streamed ``iteration`` is complete: its last results leave, and all are kept for PULLs."""
        self.flush()
        stream = self.streams.pop(iteration)
        stream.sums.on_complete = None
        layout = stream.sums.layout
        blocks: list[np.ndarray] = []
        for first, chunks in zip(layout.first_slot, layout.chunks, strict=True):
            own = stream.rows[first: first + chunks]
            blocks += [own[:-1], own[-1:]]
        self.keep(iteration, layout, blocks)

    def drop_stream(self, iteration: int) -> None:
        """``iteration`` ended without completing: its stream stops."""
        stream = self.streams.pop(iteration, None)
        if stream is not None:
            stream.sums.on_complete = None

    def keep(self, iteration: int, layout: EdgeLayout, blocks: list[np.ndarray]) -> None:
        """Keep ``iteration``'s result datagrams (two blocks per tensor) for PULLs until 4 iterations later."""
        self.kept[iteration] = (layout, blocks)
        for old in [k for k in self.kept if k < iteration - KEEP_RESULTS]:
            del self.kept[old]
        self.roster.outbox.forget(iteration - KEEP_RESULTS)

    def queue(self, iteration: int, blocks: list[np.ndarray], *, unicast: bool) -> None:
        """Queue result datagrams (blocks of rows of one width each) once to the group (or, ``unicast`` or
        without a group, a copy to each worker that said HELLO), each with its token."""
        roster = self.roster
        tokens = roster.tokens
        if roster.group is not None and not unicast:
            # one copy of each datagram; the LAN replicates it to every member of the group
            for rows in blocks:
                if not len(rows):
                    continue
                mine = with_token(rows, tokens.group(iteration)) if tokens.enabled else rows
                roster.outbox.bulk(mine, roster.group, tag=iteration)
            return
        for w in range(roster.workers):
            address = roster.addresses.get(w)
            if address is None:
                continue
            for rows in blocks:
                if not len(rows):
                    continue
                mine = with_token(rows, tokens.gateway(w, iteration)) if tokens.enabled else rows
                roster.outbox.bulk(mine, address, tag=iteration)

    def row(self, iteration: int, tensor: int, chunk: int) -> np.ndarray | None:
        """The RESULT datagram of ``(tensor, chunk)`` of ``iteration`` if it was sent (None: not kept, or its
        chunk has not completed yet); WireError for a chunk the result does not have."""
        kept = self.kept.get(iteration)
        if kept is not None:
            # kept one row per chunk of the result's layout (its tensor and chunk), not per pool slot: with
            # a pool smaller than the model the slot names several chunks
            layout, blocks = kept
            index = layout.seq(tensor, chunk) - layout.first_slot[tensor]
            full, last = blocks[2 * tensor: 2 * tensor + 2]
            return full[index: index + 1] if index < len(full) else last
        stream = self.streams.get(iteration)
        if stream is not None:
            seq = stream.sums.layout.seq(tensor, chunk)
            if stream.sent[seq]:
                return stream.rows[seq: seq + 1]
        return None
