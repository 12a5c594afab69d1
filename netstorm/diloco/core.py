"""One DC's DiLoCo state and one fragment sync as a sans-I/O core: tensors out, sums in.

``GlobalState`` holds what every DC agrees on (the flat global parameters, the outer optimizer, the
count of outer steps) and this DC's error-feedback residual. ``FragmentSync`` is one fragment's outer
all-reduce: ``tensors(round)`` is what to push as one node iteration, ``received(round, sums,
contributors)`` takes the iteration's sums, and after the last round ``mean`` is the pseudo-gradient
averaged over the contributors that pushed one (each pushes a weight: 1, or 0 for a DC left out of the
round, which still takes part in the digest). ``GlobalState.apply`` then takes the outer step. Every
push carries every registered tensor (the nodes complete an iteration when all are in), those not in
play as zeros, which the nodes send as header-only frames.
"""

from __future__ import annotations

import numpy as np

from netstorm.compression import quantize
from netstorm.diloco import state as st
from netstorm.diloco.codec import OuterCompression
from netstorm.diloco.outer import OuterSGD
from netstorm.diloco.schedule import Schedule, fragment_bounds
from netstorm.errors import IterationError

PREFIX = "netstorm.diloco."
DELTA = PREFIX + "delta"
LANES = PREFIX + "lanes"
PEAK = PREFIX + "peak"
META = PREFIX + "meta"
STATE = PREFIX + "state"


class GlobalState:
    """The state every DC holds identically, and the residual only this DC holds."""

    def __init__(self, params: np.ndarray, schedule: Schedule, outer: OuterSGD | None = None,
                 compression: OuterCompression | None = None, rejoin: bool = True) -> None:
        self.params = np.array(params, np.float32).reshape(-1)
        st.canonical(self.params)
        self.rejoin = rejoin
        """The state snapshot is registered: a job starts from the lowest DC's state and a restarted DC
        rejoins with the live one. It costs a zero tensor of the state's size in every push (header-only
        frames on the WAN, but the nodes still handle its elements)."""
        self.schedule = schedule
        self.outer = outer if outer is not None else OuterSGD()
        self.outer.bind(self.params.size)
        self.compression = compression if compression is not None else OuterCompression()
        self.halves = self.compression.method == "fp16"
        """The snapshot travels as 16-bit halves (a float16 job's nodes would round float32 values)."""
        self.bounds = fragment_bounds(self.params.size, schedule.fragments)
        self.width = self.bounds[0][1] - self.bounds[0][0]
        self.residual = np.zeros(self.params.size if self.compression.error_feedback else 0, np.float32)
        self.outer_steps = 0
        self._zeros: dict[str, np.ndarray] | None = None

    def zeros(self) -> dict[str, np.ndarray]:
        """Every registered tensor as zeros (shared arrays: callers replace entries, never write into them)."""
        if self._zeros is None:
            snapshot_words = self.snapshot(0, 0).words()
            self._zeros = {name: np.zeros_like(value) for name, value in self.registered_shapes().items()}
            if self.rejoin:
                self._zeros[STATE] = (np.zeros(2 * snapshot_words, np.int32) if self.halves
                                      else np.zeros(snapshot_words, np.float32))
        return dict(self._zeros)

    def registered_shapes(self) -> dict[str, np.ndarray]:
        tensors: dict[str, np.ndarray] = {}
        if self.compression.quantized:
            tensors[LANES] = np.zeros(self.width, self.compression.lane)
            tensors[PEAK] = np.zeros(quantize.SCALE_BUCKETS, np.uint8)
        else:
            tensors[DELTA] = np.zeros(self.width, np.float32)
        tensors[META] = np.zeros(st.META_WORDS, np.int32)
        return tensors

    def digest(self) -> bytes:
        return st.digest(self.params, self.outer.state_arrays(), self.outer_steps)

    def snapshot(self, step: int, next_sync: int, in_sync: bool = False, round_: int = 0) -> st.Snapshot:
        return st.Snapshot(self.params, self.outer.state_arrays(), step, next_sync, self.outer_steps, in_sync, round_)

    def adopt(self, snapshot: st.Snapshot) -> None:
        self.params[...] = snapshot.params
        st.canonical(self.params)
        self.outer.load_state(snapshot.outer_state)
        for array in self.outer.state_arrays():
            st.canonical(array)
        self.outer_steps = snapshot.outer_steps

    def decode_snapshot(self, halves: np.ndarray) -> st.Snapshot:
        return st.Snapshot.decode(halves, self.params.size, [a.size for a in self.outer.state_arrays()])

    def registered(self, snapshot: st.Snapshot) -> dict[str, np.ndarray]:
        """The tensors a DC registers: every fragment's sync travels in them, so the layout is fixed."""
        tensors = self.registered_shapes()
        if self.rejoin:
            tensors[STATE] = snapshot.encode(self.halves)
        return tensors

    def delta(self, fragment: int, local: np.ndarray) -> np.ndarray:
        """Delta = theta_global - theta_local of ``fragment``, zero-padded to the registered width."""
        start, stop = self.bounds[fragment]
        out = np.zeros(self.width, np.float32)
        np.subtract(self.params[start:stop], local[start:stop], out=out[:stop - start])
        return out

    def apply(self, sync: FragmentSync) -> bool:
        """The outer step of a completed sync (none when no contributor sent a pseudo-gradient)."""
        if sync.mean is None:
            return False
        start, stop = self.bounds[sync.fragment]
        self.outer.step(self.params, sync.mean[:stop - start], start, stop)
        st.canonical(self.params[start:stop])
        for array in self.outer.state_arrays():
            st.canonical(array[start:stop] if array.size == self.params.size else array)
        self.outer_steps += 1
        return True

    def merge(self, fragment: int, local: np.ndarray, alpha: float = 0.0) -> None:
        """theta_local <- alpha theta_local + (1 - alpha) theta_global on ``fragment`` (0: the global)."""
        start, stop = self.bounds[fragment]
        if alpha == 0.0:
            local[start:stop] = self.params[start:stop]
        else:
            local[start:stop] = np.float32(alpha) * local[start:stop] + np.float32(1 - alpha) * self.params[start:stop]


class FragmentSync:
    """Sync ``index`` of ``fragment``: this DC's pseudo-gradient ``delta`` (None: left out, weight 0)."""

    def __init__(self, state: GlobalState, index: int, delta: np.ndarray | None,
                 rng: np.random.Generator) -> None:
        self.state = state
        self.index = index
        self.fragment = state.schedule.fragment_of(index)
        self.weight = 0 if delta is None else 1
        self.digest = state.digest()
        self.rng = rng
        start, stop = state.bounds[self.fragment]
        self._span = (start, stop)
        target = np.zeros(state.width, np.float32) if delta is None else np.array(delta, np.float32)
        if delta is not None and state.compression.error_feedback:
            target[:stop - start] += state.residual[start:stop]
        self.target = target
        self.peak = 0.0
        self.mean: np.ndarray | None = None
        self.contributors: tuple[int, ...] = ()
        self.count = 0
        """DCs whose digests the sync summed (every contributor, left out or not)."""
        self.total_weight = 0
        self._sent: np.ndarray | None = None

    @property
    def rounds(self) -> int:
        return self.state.compression.rounds

    def tensors(self, round_: int) -> dict[str, np.ndarray]:
        """What this DC pushes in ``round_`` (0-based; one node iteration each)."""
        out = self.state.zeros()
        codec = self.state.compression
        if codec.quantized and round_ == 0:
            if self.weight:
                out[PEAK] = quantize.scale_histogram(self.target)
            return out
        out[META] = st.meta(self.weight, self.digest)
        if codec.quantized:
            if self.weight:
                out[LANES], self._sent = codec.quantize(self.target, self.peak, self.rng)
        elif self.weight:
            self._sent = codec.to_send(self.target)
            out[DELTA] = self._sent
        return out

    def received(self, round_: int, sums: dict[str, np.ndarray], contributors: tuple[int, ...]) -> None:
        codec = self.state.compression
        if codec.quantized and round_ == 0:
            self.peak = quantize.global_peak(sums[PEAK])
            return
        self.contributors = tuple(contributors)
        self.total_weight, self.count = st.check_meta(sums[META], self.digest, self.index, self.contributors)
        if self.total_weight > codec.max_contributors():
            raise IterationError(f"sync {self.index}: {self.total_weight} contributors overflow the "
                                 f"{codec.lane} lane of {codec.method}")
        if self.total_weight:
            if codec.quantized:
                self.mean = codec.dequantize(sums[LANES], self.peak, self.total_weight)
            else:
                self.mean = (np.asarray(sums[DELTA], np.float32) / np.float32(self.total_weight)).astype(np.float32)
        if self.weight and codec.error_feedback and self._sent is not None:
            start, stop = self._span
            self.state.residual[start:stop] = (self.target - self._sent)[:stop - start]

    def restart(self) -> None:
        """The sync failed in some round: it starts over (nothing of it was applied)."""
        self.peak = 0.0
        self.mean = None
        self._sent = None
