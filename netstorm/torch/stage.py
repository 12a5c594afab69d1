"""One registered round: how collectives of any size travel through a node that knows one fixed layout.

See docs/ARCHITECTURE.md, *PyTorch*."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from netstorm.compression.options import CompressionOptions
from netstorm.errors import IterationError, PeerLost
from netstorm.torch.compressed import BucketRounds

ROUND_NAME = "netstorm.torch.round"
"""The one float tensor a rank registers (every collective without compression travels in it)."""
EXACT_NAME = "netstorm.torch.exact"
"""With fp16 compression: the int32 tensor the exact collectives travel in."""


HANDOVER = 1.0
"""The control word of what a live rank hands a restarted DC's init (a new job's init holds zeros)."""

LOSS_RETRIES = 8
"""Attempts per DC of the group a collective may take under ``on_dc_loss = "continue"`` before it fails."""


class RoundClient(Protocol):
    """The part of ``netstorm.connect()``'s client a stage uses."""

    @property
    def num_workers(self) -> int: ...

    @property
    def node_id(self) -> int: ...

    @property
    def iteration(self) -> int: ...

    def init(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def push_pull(self, tensors: dict[str, np.ndarray], average: bool = False) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


@dataclasses.dataclass
class StageStats:
    """Seconds and counts since the stage started; ``overhead_s`` is the integration's own cost."""

    collectives: int = 0
    iterations: int = 0
    elements: int = 0
    """Payload elements the collectives carried."""
    padded: int = 0
    """Zero elements added to fill the last round of each collective."""
    node_s: float = 0.0
    """In ``push_pull``: the node's synchronization the backend waits on."""
    copy_s: float = 0.0
    """Copies into and out of the round."""
    overhead_s: float = 0.0
    """Encoding, decoding and bookkeeping around the node (the backend's and the hook's), copies included."""
    wan_bytes: int = 0
    """Bytes this DC's node queued on WAN links over the node iterations (the client's per-iteration count)."""
    compressed: int = 0
    """Bucket pieces that went through the compression's rounds."""
    vote_s: float = 0.0
    """Seconds in the compression's vote rounds (the extra round trip a sparse method costs)."""
    gia: int = 0
    """Indices agreed on, summed over the compressed pieces."""
    bits: int = 0
    """FediAC's b in the newest compressed piece (0 before b is known)."""
    contributors: tuple[int, ...] = ()
    """The DCs whose values the newest sum holds (fewer than the job's after a DC was lost, with
    ``on_dc_loss = "continue"``)."""
    workers: int = 0
    """The ranks the newest sum counts."""
    retried: int = 0
    """Collectives run again from their first piece because a DC was lost while they were in flight."""

    def copy(self) -> StageStats:
        return dataclasses.replace(self)


class GroupIncomplete(IterationError):
    """A node iteration's sum counts fewer (or more) trainers than the process group has ranks: a DC left
    the job (the nodes go on without it) and a collective over the whole group can no longer be formed.
    Raised instead of handing DDP a sum it would divide by the group's size."""


class Stage:
    """A connected, registered rank: ``reduce(payload)`` returns the sum (or mean) over all ranks."""

    def __init__(self, client: RoundClient, round_elements: int, compression: CompressionOptions | None = None,
                 seed: int = 0, on_dc_loss: str = "error") -> None:
        if round_elements < 1:
            raise ValueError(f"a round needs at least one element, got {round_elements}")
        if on_dc_loss not in ("error", "continue"):
            raise ValueError(f"on_dc_loss is error or continue, not {on_dc_loss!r}")
        self.client = client
        self.on_dc_loss = on_dc_loss
        """``continue``: a sum without a lost DC is the survivors' (a collective in flight when it was lost
        runs again without it); ``error``: it raises ``GroupIncomplete``."""
        self.round = round_elements
        self.compression = compression if compression is not None else CompressionOptions()
        self.may_rejoin = on_dc_loss == "continue" and self.compression.method == "none"
        """A DC lost and restarted may rejoin the group at a step boundary (``netstorm.torch.rejoin``)."""
        # the round's one extra element is the control word: 0 in every collective's iteration, set only
        # by the rejoin protocol's announcement and by the hand-over a restarted DC's init receives
        control = 1 if not self.compression.sparse else 0
        self._buffer = np.zeros(round_elements + control, dtype=np.float32)
        self._lock = threading.Lock()
        self.stats = StageStats()
        self.buckets: BucketRounds | None = None
        tensors: dict[str, np.ndarray] = {ROUND_NAME: self._buffer}
        if self.compression.sparse:
            self.buckets = BucketRounds(self.compression, ROUND_NAME, round_elements, seed)
            tensors = self.buckets.registered()
        elif self.compression.spec.float16:
            tensors[EXACT_NAME] = np.zeros(round_elements, dtype=np.int32)
        self._zeros = {name: np.zeros_like(value) for name, value in tensors.items()}
        # The init round: every DC's rank registers the same layout (hash-checked) and waits for the others.
        if self.compression.method == "none":
            initial = client.init(tensors)
        else:
            init: Any = client.init  # a node's client (netstorm.Client) takes the compression at init
            initial = init(tensors, compression=self.compression.method, votes=self.compression.votes)
        self.rejoining = bool(control) and float(np.asarray(initial[ROUND_NAME])[round_elements]) == HANDOVER
        """This rank's DC was admitted into a running job: its init got a live rank's hand-over, not the
        job's first values (every rank of a new job registers zeros)."""
        if control and hasattr(client, "set_model_provider"):
            client.set_model_provider(self._handover)
        self.group_workers = client.num_workers
        """Trainers every sum must count: the job's at init, the process group's ranks."""
        self._group_dcs: tuple[int, ...] = ()
        """The DCs of the first complete sum (named when one of them is missing later)."""
        self._live: tuple[int, ...] = ()
        """The DCs whose ranks take part in the group's collectives (the survivors after a loss)."""
        self._joining: tuple[tuple[int, ...], int] | None = None
        """DCs restarted into the job whose ranks push zeros until the next step boundary admits them to
        the group, and how many trainers they add to each sum's count."""
        self._counted = 0
        """The trainers the newest sum counts, the pending joiners' left out."""
        if self.buckets is not None:
            self.buckets.start(client.num_workers, client.node_id, int(getattr(client, "gia_threshold", 0)))

    @property
    def workers(self) -> int:
        """Ranks whose values make up each sum (every DC's trainers, as its node counts them, without the
        ranks of a restarted DC that has not reached its step boundary yet)."""
        return self._counted or self.client.num_workers

    @property
    def join_pending(self) -> tuple[int, ...]:
        """DCs restarted into the job whose ranks wait for the next step boundary (empty: none)."""
        with self._lock:
            return self._joining[0] if self._joining is not None else ()

    def _handover(self) -> dict[str, np.ndarray]:
        """What this rank hands a DC admitted into the running job at the node's boundary iteration: zeros
        with the control word set, which tells the joiner's ranks to wait for a step boundary."""
        model = {name: np.zeros_like(value) for name, value in self._zeros.items()}
        model[ROUND_NAME][self.round] = HANDOVER
        return model

    def exchange(self, payload: np.ndarray, control: float = 0.0) -> tuple[np.ndarray, float]:
        """One node iteration outside any collective, for the rejoin protocol: ``payload`` (at most a round)
        and the control word in; their sums over every rank out (the whole round, and the control's)."""
        if self.buckets is not None:
            raise ValueError("the rejoin protocol needs the plain round (compression none)")
        size = int(payload.size)
        if size > self.round:
            raise ValueError(f"an exchange holds at most {self.round} elements, not {size}")
        with self._lock:
            self._buffer[:size] = payload
            self._buffer[size:] = 0.0
            self._buffer[self.round] = control
            result = self._push_pull({ROUND_NAME: self._buffer}, average=False)[ROUND_NAME]
            return np.array(result[:self.round], dtype=np.float32), float(result[self.round])

    def admit_joiners(self) -> None:
        """The group takes in the pending joiners (both sides of the rejoin protocol, before its first
        iteration): from now on every sum must count them."""
        with self._lock:
            self._joining = None
            self._live = ()
            self._counted = 0

    @property
    def node_id(self) -> int:
        return self.client.node_id

    @property
    def iteration(self) -> int:
        """The newest node iteration this rank has completed (-1 before the first)."""
        return self.client.iteration

    def contributors(self) -> tuple[int, ...]:
        """The DCs whose values the newest node iteration's sums hold (empty before the first)."""
        return tuple(getattr(self.client, "contributors", ()))

    def reduce(self, payload: np.ndarray, *, average: bool = False, exact: bool = False) -> np.ndarray:
        """The element-wise sum (or mean over ``workers``) of ``payload`` over every rank, in as many node
        iterations as it takes; every rank must call it with a payload of the same size. ``exact``: the
        payload holds whole 16-bit pieces (``codec.bits``) that must come back unrounded (with fp16
        compression they travel in the int32 tensor).

        With ``on_dc_loss = "continue"`` a DC lost while the collective is in flight (its iteration fails
        at every DC with ``PeerLost``) makes every survivor run the collective again from its first piece,
        so each sum holds the same DCs throughout: the survivors'."""
        return self._again_on_loss(lambda: self._reduce(payload, average=average, exact=exact))

    def _again_on_loss(self, run: Callable[[], np.ndarray]) -> np.ndarray:
        """``run()``, run again from its first piece after a DC lost in flight under ``on_dc_loss =
        "continue"``: the iterations a node had already bound to the policy naming the lost DC (its
        prefetch) fail the same way until a re-plan leaves it out, so a few tries per lost DC."""
        losses = 0
        while True:
            try:
                return run()
            except PeerLost:
                losses += 1
                if self.on_dc_loss != "continue" or losses > LOSS_RETRIES * max(1, len(self._group_dcs)):
                    raise
                with self._lock:
                    self.stats.retried += 1

    def _reduce(self, payload: np.ndarray, *, average: bool, exact: bool) -> np.ndarray:
        size = int(payload.size)
        out = np.empty(size, dtype=np.float32)
        lane = EXACT_NAME if exact and EXACT_NAME in self._zeros else ROUND_NAME
        plain = len(self._zeros) == 1
        with self._lock:
            self.stats.collectives += 1
            self.stats.elements += size
            for start in range(0, max(size, 1), self.round):
                stop = min(size, start + self.round)
                began = time.perf_counter()
                if lane == ROUND_NAME:
                    buffer = self._buffer
                    buffer[:stop - start] = payload[start:stop]
                    buffer[stop - start:] = 0.0
                else:
                    buffer = np.zeros(self.round, dtype=np.int32)
                    buffer[:stop - start] = payload[start:stop]
                push = {ROUND_NAME: self._buffer} if plain else {**self._zeros, lane: buffer}
                self.stats.padded += self.round - (stop - start)
                pushed = time.perf_counter()
                # the mean is taken here, over the ranks the sum counts (a pending joiner's zeros are in
                # the sum, its ranks not in the count): the same division the node would do
                result = self._push_pull(push, average=False)[lane]
                pulled = time.perf_counter()
                out[start:stop] = result[:stop - start]
                if average:
                    out[start:stop] /= np.float32(self._counted)
                done = time.perf_counter()
                self.stats.node_s += pulled - pushed
                self.stats.copy_s += (pushed - began) + (done - pulled)
                self.stats.overhead_s += (pushed - began) + (done - pulled)
        return out

    def reduce_slot(self, payload: np.ndarray, slot: int, slots: int, *, exact: bool = False) -> np.ndarray:
        """The sum of ``payload`` over the ranks of one group of a partition of the job's ranks, whose groups
        run a collective together, each in its ``slot`` of every node iteration's round. The groups' payloads
        may differ in size (a gather's grows with its group's ranks): the round's last element counts the
        ranks with more to send, and the iterations go on until it is 0, the same number at every rank.
        A DC lost in flight runs it again, as ``reduce`` does."""
        return self._again_on_loss(lambda: self._reduce_slot(payload, slot, slots, exact=exact))

    def _reduce_slot(self, payload: np.ndarray, slot: int, slots: int, *, exact: bool) -> np.ndarray:
        if not 0 <= slot < slots:
            raise ValueError(f"slot {slot} of {slots}")
        width = (self.round - 1) // slots
        if width < 1:
            raise ValueError(f"a round of {self.round} elements holds no {slots} group slots and a count")
        size = int(payload.size)
        out = np.empty(size, dtype=np.float32)
        lane = EXACT_NAME if exact and EXACT_NAME in self._zeros else ROUND_NAME
        with self._lock:
            self.stats.collectives += 1
            self.stats.elements += size
            start = 0
            while True:
                began = time.perf_counter()
                stop = min(size, start + width)
                frame = np.zeros(self.round + (1 if lane == ROUND_NAME and self._buffer.size > self.round else 0),
                                 dtype=np.float32 if lane == ROUND_NAME else np.int32)
                at = slot * width
                frame[at:at + stop - start] = payload[start:stop]
                frame[self.round - 1] = 1 if stop < size else 0
                push = {**self._zeros, lane: frame}
                self.stats.padded += self.round - (stop - start)
                pushed = time.perf_counter()
                result = np.asarray(self._push_pull(push, average=False)[lane])
                pulled = time.perf_counter()
                out[start:stop] = result[at:at + stop - start]
                more = round(float(result[self.round - 1]))
                done = time.perf_counter()
                self.stats.node_s += pulled - pushed
                self.stats.copy_s += (pushed - began) + (done - pulled)
                self.stats.overhead_s += (pushed - began) + (done - pulled)
                start = stop
                if more == 0:
                    return out

    def reduce_compressed(self, payload: np.ndarray, bucket: tuple[int, ...]) -> np.ndarray:
        """The sum over every rank of a gradient ``payload`` through the job's compression, error feedback
        kept per piece of ``bucket`` (a key the same at every rank, e.g. DDP's bucket index and size).
        Without a sparse method it is ``reduce`` (fp16 then travels as float16 on the WAN). If a piece
        fails (the node's error, ``GroupIncomplete``), every piece's rounds are undone before the error
        goes on, so a later call computes what it would had this one never been made (``compressed.py``)."""
        if self.buckets is None:
            return self.reduce(payload)
        buckets = self.buckets
        size = int(payload.size)
        out = np.empty(size, dtype=np.float32)
        with self._lock, buckets.collective():  # a piece that fails undoes the bucket's rounds
            self.stats.collectives += 1
            self.stats.elements += size
            for piece, start in enumerate(range(0, max(size, 1), self.round)):
                stop = min(size, start + self.round)
                began = time.perf_counter()
                self._buffer[:stop - start] = payload[start:stop]
                self._buffer[stop - start:] = 0.0
                self.stats.padded += self.round - (stop - start)
                steps = buckets.iteration((*bucket, piece), self._buffer)
                push = next(steps)
                spent = time.perf_counter() - began
                node = 0.0
                trips: list[float] = []
                try:
                    while True:
                        pushed = time.perf_counter()
                        result = self._push_pull(push, average=False)
                        trips.append(time.perf_counter() - pushed)
                        resumed = time.perf_counter()
                        try:
                            push = steps.send(result)
                        except StopIteration as done:
                            summed: np.ndarray = done.value
                            break
                        finally:
                            spent += time.perf_counter() - resumed
                finally:
                    steps.close()
                node += sum(trips)
                finished = time.perf_counter()
                out[start:stop] = summed[:stop - start]
                spent += time.perf_counter() - finished
                self.stats.node_s += node
                self.stats.overhead_s += spent
                self.stats.compressed += 1
                last = buckets.last
                self.stats.gia += last.gia
                self.stats.bits = last.bits
                if len(trips) == 2:
                    self.stats.vote_s += trips[0]
        return out

    def _push_pull(self, push: dict[str, np.ndarray], *, average: bool) -> dict[str, np.ndarray]:
        """One node iteration; counts it and the WAN bytes the node queued for it."""
        result = self.client.push_pull(push, average=average)
        self.stats.iterations += 1
        self.stats.wan_bytes += int(getattr(self.client, "wan_bytes", 0))
        dcs = tuple(getattr(self.client, "contributors", ()))
        workers = self.client.num_workers
        joining = tuple(sorted(set(dcs) - set(self._live))) if self._live and dcs else ()
        if joining and self.may_rejoin:
            # a DC restarted into the job: its ranks push zeros until the next step boundary admits them
            if self._joining is None or self._joining[0] != joining:
                self._joining = (joining, workers - self._counted)
            self._counted = workers - self._joining[1]
            self.stats.contributors, self.stats.workers = dcs, self._counted
            return result
        self._joining = None
        self._counted = workers
        self.stats.contributors, self.stats.workers = dcs, workers
        if joining:
            raise GroupIncomplete(
                f"node iteration {self.client.iteration}: DC(s) {list(joining)} came back into the job, which "
                f"only a group with on_dc_loss = continue and compression none takes in (at a step boundary, "
                f"netstorm.torch.step_boundary)")
        if workers == self.group_workers:
            self._group_dcs = self._group_dcs or dcs
            self._live = dcs
        elif self.on_dc_loss == "continue" and workers < self.group_workers and self.buckets is None:
            self._live = dcs  # the survivors' sum: the stats name its DCs
        else:
            gone = sorted(set(self._group_dcs) - set(dcs))
            left = f"{', '.join(f'node {d}' for d in gone)} left the job" if gone else "a DC left the job"
            raise GroupIncomplete(
                f"node iteration {self.client.iteration}: the sum counts {self.client.num_workers} trainers"
                f"{f' (DCs {list(dcs)})' if dcs else ''}, but every collective of this group needs all "
                f"{self.group_workers}: {left}")
        return result

    def charge(self, seconds: float) -> None:
        """Add the caller's own encoding or decoding time to the integration's cost."""
        with self._lock:
            self.stats.overhead_s += seconds

    def snapshot(self) -> StageStats:
        with self._lock:
            return self.stats.copy()

    def close(self) -> None:
        self.client.close()
