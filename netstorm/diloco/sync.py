"""DiLoCo over the trainer API: each fragment sync runs as NetStorm iterations on the multi-root trees.

```python
dl = DiLoCo(netstorm.connect(), {"w": w0, "b": b0}, sync_every=100, fragments=4, fragment_delay=5)
for batch in data:
    inner_update(dl.params, batch)    # the inner optimizer trains dl.params (views of dl.local) in place
    dl.step()                         # sends a fragment, or applies one tau steps after it was sent
```

Syncs run in one worker thread, so a fragment's all-reduce overlaps the inner steps after it. Lost DCs,
stragglers (``straggler_s``), rejoin and ``rejoin=False`` are in docs/ARCHITECTURE.md, *PyTorch: DiLoCo*.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from netstorm.diloco.codec import Method, OuterCompression
from netstorm.diloco.core import STATE, FragmentSync, GlobalState
from netstorm.diloco.outer import OuterSGD
from netstorm.diloco.schedule import Schedule
from netstorm.errors import IterationError


class SyncClient(Protocol):
    """What DiLoCo uses of ``netstorm.connect()``'s client."""

    @property
    def contributors(self) -> tuple[int, ...]: ...

    @property
    def node_id(self) -> int: ...

    @property
    def wan_bytes(self) -> int: ...

    def init(self, tensors: Mapping[str, np.ndarray], *, compression: str = "none") -> dict[str, np.ndarray]: ...

    def push_pull(self, tensors: Mapping[str, np.ndarray], average: bool = False) -> dict[str, np.ndarray]: ...

    def set_model_provider(self, provider: Any) -> None: ...


@dataclasses.dataclass(frozen=True)
class SyncRecord:
    """One completed fragment sync, as this DC saw it."""

    index: int
    fragment: int
    seconds: float
    """From the first push to the last round's sums (retries included)."""
    contributors: tuple[int, ...]
    weight: int
    """DCs whose pseudo-gradients the mean is over."""
    left_out: bool
    attempts: int
    wan_bytes: int
    digest: str
    """This DC's digest of the global state the sync started from (agreed by every contributor)."""
    began: float = 0.0
    """Wall-clock time of its first push: the emulator bounds it by the rates in force from then on."""


class DiLoCo:
    """DiLoCo / Streaming DiLoCo of one DC over a NetStorm trainer client; see the module docstring."""

    def __init__(self, kv: SyncClient, params: Mapping[str, np.ndarray], *, sync_every: int, fragments: int = 1,
                 fragment_delay: int = 0, outer: OuterSGD | None = None, outer_compression: Method = "none",
                 error_feedback: bool = False, merge_alpha: float = 0.0, straggler_s: float | None = None,
                 seed: int = 0, max_attempts: int = 8, rejoin: bool = True) -> None:
        self.kv = kv
        self.schedule = Schedule(sync_every, fragments, fragment_delay)
        self.shapes = {name: np.shape(value) for name, value in params.items()}
        self.local = np.concatenate([np.asarray(v, np.float32).reshape(-1) for v in params.values()])
        self.params: dict[str, np.ndarray] = {}
        at = 0
        for name, shape in self.shapes.items():
            size = int(np.prod(shape, dtype=np.int64))
            self.params[name] = self.local[at:at + size].reshape(shape)
            at += size
        self.compression = OuterCompression(outer_compression, error_feedback)
        self.state = GlobalState(self.local, self.schedule, outer if outer is not None else OuterSGD(),
                                 self.compression, rejoin)
        self.merge_alpha = merge_alpha
        self.straggler_s = straggler_s
        self.max_attempts = max_attempts
        self.records: list[SyncRecord] = []
        self.last_wait_s = 0.0
        """Seconds the last ``step()`` waited for a sync's result (blocking syncs, or a late one)."""
        self._lock = threading.Lock()
        self._claimed: set[int] = set()
        self._pending: dict[int, concurrent.futures.Future[SyncRecord]] = {}
        self._timer: threading.Timer | None = None
        self._current: tuple[int, int] | None = None
        self._closed = False
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="diloco-sync")
        got = kv.init(self.state.registered(self.state.snapshot(0, 0)),
                      compression="fp16" if outer_compression == "fp16" else "none")
        self.rng = np.random.default_rng([seed, max(kv.node_id, 0)])
        snapshot = (self.state.decode_snapshot(got[STATE]) if rejoin
                    else self.state.snapshot(0, 0))  # without it every DC must start alike: sync 0's digest checks
        self.state.adopt(snapshot)
        self.local[...] = self.state.params
        self.steps = snapshot.step
        self.joined_at = snapshot.step if snapshot.in_sync or snapshot.step else None
        """The inner step this DC took over from a running job (None: it started with the job)."""
        kv.set_model_provider(self._provide)
        if snapshot.in_sync:  # admitted during sync next_sync: take part in its remaining rounds, weight 0
            self._submit(snapshot.next_sync, None, snapshot.round)
            if self.schedule.delay == 0:
                self._apply(snapshot.next_sync)
        else:
            self._arm(snapshot.next_sync)

    # ---- the trainer's side -------------------------------------------------------------------------

    def step(self) -> SyncRecord | None:
        """One inner step done (``params`` updated in place): send a fragment or apply one, as scheduled.
        Returns the record of a sync applied now."""
        self.steps += 1
        self.last_wait_s = 0.0
        sent = self.schedule.sent_after(self.steps)
        if sent is not None:
            index = self.schedule.sync_index(self.steps)
            with self._lock:
                mine = index not in self._claimed
                if mine:
                    self._claimed.add(index)
            if mine:
                self._submit(index, self.state.delta(sent, self.local), 0)
        applied = self.schedule.applied_after(self.steps)
        if applied is not None:
            return self._apply(applied)
        return None

    def _apply(self, index: int) -> SyncRecord | None:
        with self._lock:
            future = self._pending.pop(index, None)
        if future is None:  # a sync before this DC joined
            return None
        waited = time.monotonic()
        record = future.result()
        self.last_wait_s = time.monotonic() - waited
        self.state.merge(self.schedule.fragment_of(index), self.local, self.merge_alpha)
        return record

    def in_flight(self) -> int:
        return len(self._pending)

    def digest(self) -> bytes:
        return self.state.digest()

    def close(self) -> None:
        """Wait for the sync in flight (its result is left unapplied) and stop the worker."""
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
        self._executor.shutdown(wait=True)

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the worker ---------------------------------------------------------------------------------

    def _submit(self, index: int, delta: np.ndarray | None, start_round: int) -> None:
        with self._lock:
            self._claimed.add(index)
            self._pending[index] = self._executor.submit(self._run, index, delta, start_round)

    def _arm(self, index: int) -> None:
        """Leave this DC out of sync ``index`` if it has not sent it ``straggler_s`` from now."""
        if self.straggler_s is None:
            return
        with self._lock:
            if self._closed:
                return
            self._timer = threading.Timer(self.straggler_s, self._deadline, (index,))
            self._timer.daemon = True
            self._timer.start()

    def _deadline(self, index: int) -> None:
        with self._lock:
            if index in self._claimed or self._closed:
                return
            self._claimed.add(index)
            self._pending[index] = self._executor.submit(self._run, index, None, 0)

    def _run(self, index: int, delta: np.ndarray | None, start_round: int) -> SyncRecord:
        sync = FragmentSync(self.state, index, delta, self.rng)
        began = time.time()
        started = time.monotonic()
        wan = 0
        attempt = 0
        first = start_round
        while True:
            attempt += 1
            try:
                for round_ in range(first, sync.rounds):
                    self._current = (index, round_)
                    sums = self.kv.push_pull(sync.tensors(round_))
                    wan += self.kv.wan_bytes
                    sync.received(round_, sums, self.kv.contributors)
                break
            except IterationError:  # a peer DC lost (PeerLost) or the iteration failed: run it again
                if attempt >= self.max_attempts:
                    raise
                sync.restart()
                first = 0
            finally:
                self._current = None
        self.state.apply(sync)
        record = SyncRecord(index, sync.fragment, time.monotonic() - started, sync.contributors,
                            sync.total_weight, delta is None, attempt, wan, sync.digest.hex(), began)
        self.records.append(record)
        self._arm(index + 1)
        return record

    def _provide(self) -> dict[str, np.ndarray]:
        """The live global state for a DC admitted now (called by the client inside a sync's push)."""
        current = self._current
        if current is None:
            raise IterationError("the node asked for the model outside a sync")
        index, round_ = current
        snapshot = self.state.snapshot(self.schedule.sync_step(index), index, True, round_)
        tensors = {name: value.astype(np.float32) for name, value in self.state.zeros().items()}
        if not self.state.rejoin:
            raise IterationError("a DC joins the job, but this one registered no state to hand over (rejoin=False)")
        tensors[STATE] = snapshot.encode(self.state.halves).astype(np.float32)
        return tensors
