"""The aggregation core of a general node: a sans-I/O state machine over (iteration, chunk).

See docs/ARCHITECTURE.md, *One chunk, from trainer to root and back*."""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from netstorm.allot import allot_chunks
from netstorm.errors import ChunkError
from netstorm.frames import FLOAT_WIRE, WIRE_FORMATS, ChunkHeader, Phase, WireDtype
from netstorm.layout import INT_EXACT, Chunk, Layout
from netstorm.policy import Policy


@dataclasses.dataclass(frozen=True)
class Send:
    """Send ``payload`` as ``header``'s hop to ``header.dst`` (t_send is stamped by the sender)."""

    header: ChunkHeader
    payload: np.ndarray


@dataclasses.dataclass(frozen=True)
class KeyDone:
    """Every chunk of tensor ``key`` holds the full sum for ``iteration``."""

    iteration: int
    key: int


@dataclasses.dataclass(frozen=True)
class IterationDone:
    iteration: int


class Cause(enum.StrEnum):
    """Why an iteration failed; each cause is an exception class of its own for the waiters."""

    FAILED = "failed"
    """Invalid data, or a policy this node cannot hold."""
    GONE = "gone"
    """A peer the iteration needs died."""
    TIMEOUT = "timeout"
    """The iteration ran past ``iteration_timeout``."""


@dataclasses.dataclass(frozen=True)
class IterationFailed:
    iteration: int
    reason: str
    cause: Cause = Cause.FAILED


Action = Send | KeyDone | IterationDone | IterationFailed


class _Iteration:
    """Everything one iteration holds at this node."""

    def __init__(self, number: int, layout: Layout) -> None:
        n_chunks = len(layout.chunks)
        self.number = number
        self.acc = np.zeros(layout.total, dtype=np.float32)
        self.ints = np.zeros(max(0, layout.total - layout.int_start), dtype=np.int32)
        """Exact sums of the integer chunks, from ``layout.int_start`` on."""
        self.policy: Policy | None = None
        self.roots: list[int] = []
        self.pushed = np.zeros(len(layout.tensors), dtype=bool)
        self.parts: dict[int, np.ndarray] = {}
        """Tensors contributed part by part (``ChunkCore.push_part``): which of their parts are in."""
        self.local_missing = np.array([c.last_key - c.first_key + 1 for c in layout.chunks], dtype=np.int64)
        self.arrived: list[set[int]] = [set() for _ in range(n_chunks)]
        self.sent_up = np.zeros(n_chunks, dtype=bool)
        self.done = np.zeros(n_chunks, dtype=bool)
        self.key_remaining = np.array([hi - lo for lo, hi in layout.key_chunks], dtype=np.int64)
        self.chunks_left = n_chunks
        self.pending: list[tuple[ChunkHeader, np.ndarray]] = []
        self.pending_seen: set[tuple[int, int, int]] = set()


class ChunkCore:
    """Aggregation state of node ``node_id``; see the module docstring."""

    def __init__(self, node_id: int, layout: Layout | None = None) -> None:
        self.node_id = node_id
        self.layout: Layout | None = None
        self._iterations: dict[int, _Iteration] = {}
        self._early: dict[int, list[tuple[ChunkHeader, np.ndarray]]] = {}
        self._early_seen: set[tuple[int, int, int, int]] = set()
        self._closed: dict[int, str] = {}
        self._roots_cache: dict[int, list[int]] = {}
        self.horizon = 1
        """Highest iteration a peer may send chunks for: no peer runs more than ``max_ahead`` iterations
        past this node's slowest tensor (``NodeCore`` keeps this up to date), so anything beyond is a
        broken peer, not early data to keep."""
        self.peak_live = 0
        """Most iterations held at once: 2 means a peer's next iteration reached us while ours ran."""
        if layout is not None:
            self.set_layout(layout)

    # ---- inputs -------------------------------------------------------------------------------------

    def set_layout(self, layout: Layout) -> list[Action]:
        """Fix the layout (once); chunks that arrived before it are processed now."""
        if self.layout is not None:
            if layout.hash != self.layout.hash:
                raise ChunkError(f"node {self.node_id}: layout {layout.hash} differs from the registered "
                                 f"{self.layout.hash}")
            return []
        self.layout = layout
        actions: list[Action] = []
        early, self._early = self._early, {}
        self._early_seen.clear()
        for iteration, items in sorted(early.items()):
            for header, payload in items:
                try:
                    actions += self.receive(header, payload)
                except ChunkError as exc:
                    actions += self.fail(iteration, str(exc))
        return actions

    def bind_policy(self, iteration: int, policy: Policy) -> list[Action]:
        """Bind ``iteration`` to ``policy``; buffered chunks of that iteration are processed now."""
        state = self._state(iteration)
        if state is None:
            return []
        if state.policy is not None:
            if state.policy.version != policy.version:
                return self.fail(iteration, f"iteration {iteration} was bound to policy version "
                                            f"{state.policy.version}, now offered {policy.version}")
            return []
        if self.node_id not in policy.trees[policy.roots[0]].parent:
            return self.fail(iteration, f"node {self.node_id} is not part of policy version {policy.version} "
                                        f"bound to iteration {iteration}")
        state.policy = policy
        state.roots = self._roots(policy)
        actions: list[Action] = []
        pending, state.pending = state.pending, []
        state.pending_seen.clear()
        for header, payload in pending:
            try:
                actions += self._deliver(state, header, payload)
            except ChunkError as exc:
                actions += self.fail(iteration, str(exc))
                break
        for index in range(len(state.roots)):
            actions += self._advance(state, index)
        return actions

    def push_local(self, iteration: int, key: int, values: np.ndarray | None) -> list[Action]:
        """Add this DC's contribution for tensor ``key`` to ``iteration``; None contributes zeros."""
        layout = self._need_layout()
        state = self._open_state(iteration, key)
        spec = layout.tensors[key]
        if state.pushed[key] or key in state.parts:
            raise ChunkError(f"tensor {spec.name!r} pushed twice in iteration {iteration}")
        self._check_values(key, values, spec.size)
        state.pushed[key] = True
        self._add(state, key, 0, values)
        lo, hi = layout.key_chunks[key]
        state.local_missing[lo:hi] -= 1
        actions: list[Action] = []
        if state.policy is not None:
            for index in range(lo, hi):
                actions += self._advance(state, index)
        return actions

    def push_part(self, iteration: int, key: int, part: int, values: np.ndarray | None) -> list[Action]:
        """Add this DC's contribution for part ``part`` of tensor ``key`` (``layout.key_parts(key)[part]``, a
        chunk the tensor fills alone) to ``iteration``; None contributes zeros. The chunk can go up at once,
        before the tensor's other parts are in (a gateway's LAN sum arrives chunk by chunk); the tensor
        counts as pushed once every part is."""
        layout = self._need_layout()
        state = self._open_state(iteration, key)
        spec = layout.tensors[key]
        parts = layout.key_parts(key)
        if not 0 <= part < len(parts):
            raise ChunkError(f"tensor {spec.name!r} has {len(parts)} parts, no part {part}")
        done = state.parts.setdefault(key, np.zeros(len(parts), dtype=bool))
        if state.pushed[key] or done[part]:
            raise ChunkError(f"tensor {spec.name!r} part {part} pushed twice in iteration {iteration}")
        start, stop = parts[part]
        self._check_values(key, values, stop - start)
        done[part] = True
        state.pushed[key] = bool(done.all())
        self._add(state, key, start, values)
        index = layout.key_chunks[key][0] + part if len(parts) > 1 else None
        lo, hi = (index, index + 1) if index is not None else layout.key_chunks[key]
        state.local_missing[lo:hi] -= 1
        actions: list[Action] = []
        if state.policy is not None:
            for i in range(lo, hi):
                actions += self._advance(state, i)
        return actions

    def add_piece(self, iteration: int, key: int, start: int, values: np.ndarray) -> None:
        """Elements ``start`` on of this DC's contribution of tensor ``key`` to ``iteration``, added to its sums
        ahead of ``push_local(iteration, key, None)``, which counts the tensor (nothing goes up before): a
        tensor of tens of millions of elements that shares a chunk is added in pieces between turns of the
        node's loop. A failed iteration drops its sums, pieces and all."""
        layout = self._need_layout()
        state = self._open_state(iteration, key)
        spec = layout.tensors[key]
        if state.pushed[key] or key in state.parts:
            raise ChunkError(f"tensor {spec.name!r} pushed twice in iteration {iteration}")
        if start < 0 or start + values.size > spec.size:
            raise ChunkError(f"tensor {spec.name!r}: elements {start}..{start + values.size} of {spec.size}")
        self._check_values(key, values, values.size)
        self._add(state, key, start, values)

    def key_pushed(self, iteration: int, key: int) -> bool:
        """Whether this DC's whole contribution of tensor ``key`` to ``iteration`` is in."""
        state = self._iterations.get(iteration)
        return state is not None and bool(state.pushed[key])

    def _open_state(self, iteration: int, key: int) -> _Iteration:
        layout = self._need_layout()
        state = self._state(iteration)
        if state is None:
            raise ChunkError(f"iteration {iteration} is already {self._closed[iteration]}")
        if not 0 <= key < len(layout.tensors):
            raise ChunkError(f"no tensor with index {key}")
        return state

    def _check_values(self, key: int, values: np.ndarray | None, size: int) -> None:
        layout = self._need_layout()
        spec = layout.tensors[key]
        if values is not None and values.size != size:
            raise ChunkError(f"tensor {spec.name!r}: {values.size} values for {size} elements")
        if values is not None and layout.is_int(key):
            flat = values.reshape(-1)
            if flat.dtype.kind == "f" and not np.array_equal(np.rint(flat), flat):
                raise ChunkError(f"tensor {spec.name!r} ({spec.dtype}): values must be integers")
            if flat.size and float(np.max(np.abs(flat))) > INT_EXACT:
                raise ChunkError(f"tensor {spec.name!r} ({spec.dtype}): |value| beyond 2**24, the exact range")

    def _add(self, state: _Iteration, key: int, start: int, values: np.ndarray | None) -> None:
        """Add ``values`` at element ``start`` of tensor ``key`` into the iteration's sums."""
        if values is None:
            return
        layout = self._need_layout()
        flat = values.reshape(-1)
        first = layout.offsets[key] + start
        if layout.is_int(key):
            ints = state.ints[first - layout.int_start:first - layout.int_start + flat.size]
            np.add(ints, flat, out=ints, casting="unsafe")
        else:
            target = state.acc[first:first + flat.size]
            np.add(target, flat, out=target, casting="same_kind")

    def receive(self, header: ChunkHeader, payload: np.ndarray) -> list[Action]:
        """A chunk hop addressed to this node. Raises ChunkError for input no correct peer sends."""
        if header.dst != self.node_id:
            raise ChunkError(f"node {self.node_id} received a hop addressed to node {header.dst}")
        if header.final != self.node_id:
            return [self._forward(header, payload)]
        if header.iteration > self.horizon:
            raise ChunkError(f"chunk {header.chunk} from node {header.origin} for iteration {header.iteration}, but "
                             f"node {self.node_id} has not reached iteration {header.iteration - 1}")
        if header.iteration in self._closed:
            if self._closed[header.iteration] == "failed":
                return []
            raise ChunkError(f"chunk {header.chunk} from node {header.origin} for iteration {header.iteration}, "
                             f"which already finished: a duplicate")
        if self.layout is None:
            early_key = (header.iteration, int(header.phase), header.chunk, header.origin)
            if early_key in self._early_seen:
                raise ChunkError(f"duplicate {header.phase.name} contribution of chunk {header.chunk} from node "
                                 f"{header.origin} in iteration {header.iteration}")
            self._early_seen.add(early_key)
            self._early.setdefault(header.iteration, []).append((header, payload))
            return []
        self._check_shape(header, payload)
        state = self._state(header.iteration)
        assert state is not None
        if state.policy is None:
            key = (int(header.phase), header.chunk, header.origin)
            if key in state.pending_seen:
                raise ChunkError(f"duplicate {header.phase.name} contribution of chunk {header.chunk} from node "
                                 f"{header.origin} in iteration {header.iteration}")
            state.pending_seen.add(key)
            state.pending.append((header, payload))
            return []
        return self._deliver(state, header, payload)

    def fail(self, iteration: int, reason: str, cause: Cause = Cause.FAILED) -> list[Action]:
        """Give up on ``iteration`` (dead peer, timeout, invalid data); later chunks for it are ignored."""
        if self._closed.get(iteration) is not None:
            return []
        self._iterations.pop(iteration, None)
        self._early.pop(iteration, None)
        self._closed[iteration] = "failed"
        return [IterationFailed(iteration, reason, cause)]

    def release(self, iteration: int) -> None:
        """Forget a completed iteration's buffers (the trainer has read the result)."""
        state = self._iterations.get(iteration)
        if state is not None and state.chunks_left:
            raise ChunkError(f"iteration {iteration} released with {state.chunks_left} chunks outstanding")
        self._iterations.pop(iteration, None)
        self._closed.setdefault(iteration, "finished")

    # ---- queries ------------------------------------------------------------------------------------

    def result(self, iteration: int) -> np.ndarray:
        """The iteration's flat float32 vector: full sums wherever a chunk is done."""
        state = self._iterations.get(iteration)
        if state is None:
            raise ChunkError(f"iteration {iteration} is not held (state: {self._closed.get(iteration, 'unknown')})")
        return state.acc

    def key_done(self, iteration: int, key: int) -> bool:
        state = self._iterations.get(iteration)
        return state is not None and bool(state.key_remaining[key] == 0)

    def is_done(self, iteration: int) -> bool:
        state = self._iterations.get(iteration)
        return state is not None and state.chunks_left == 0

    def live_iterations(self) -> list[int]:
        return sorted(self._iterations)

    def has_policy(self, iteration: int) -> bool:
        state = self._iterations.get(iteration)
        return state is not None and state.policy is not None

    def status(self, iteration: int) -> str:
        """A short description for error messages: what the iteration still waits for."""
        state = self._iterations.get(iteration)
        if state is None:
            return self._closed.get(iteration, "not started")
        if state.policy is None:
            return f"waiting for its policy ({len(state.pending)} chunks buffered)"
        waiting = int(np.count_nonzero(~state.done))
        local = int(np.count_nonzero(state.local_missing > 0))
        return f"{waiting} chunks outstanding ({local} still lacking this DC's contribution)"

    # ---- internals ----------------------------------------------------------------------------------

    def _need_layout(self) -> Layout:
        if self.layout is None:
            raise ChunkError(f"node {self.node_id} has no layout yet: the trainer has not registered")
        return self.layout

    def _state(self, iteration: int) -> _Iteration | None:
        state = self._iterations.get(iteration)
        if state is None:
            if iteration in self._closed:
                return None
            state = _Iteration(iteration, self._need_layout())
            self._iterations[iteration] = state
            self.peak_live = max(self.peak_live, len(self._iterations))
        return state

    def _roots(self, policy: Policy) -> list[int]:
        roots = self._roots_cache.get(policy.version)
        if roots is None:
            roots = list(allot_chunks(self._need_layout().chunk_sizes(), policy.chunk_share))
            self._roots_cache = {policy.version: roots}
        return roots

    def check_header(self, header: ChunkHeader) -> None:
        """A chunk header's index, element count and wire dtype against the layout, before its payload is
        allocated: at most the chunk's elements, a float dtype for a float chunk, an integer one else."""
        layout = self._need_layout()
        if not 0 <= header.chunk < len(layout.chunks):
            raise ChunkError(f"chunk index {header.chunk} out of range (layout has {len(layout.chunks)})")
        chunk = layout.chunks[header.chunk]
        if header.count > chunk.count:
            raise ChunkError(f"chunk {header.chunk} of iteration {header.iteration} from node {header.origin}: "
                             f"{header.count} elements, layout says {chunk.count}")
        if (header.dtype in FLOAT_WIRE) != (chunk.dtype == "float32"):
            raise ChunkError(f"chunk {header.chunk} of iteration {header.iteration} from node {header.origin}: "
                             f"{header.dtype} payload for a {chunk.dtype} chunk")

    def _check_shape(self, header: ChunkHeader, payload: np.ndarray) -> None:
        self.check_header(header)
        if payload.size != header.payload_items or payload.dtype != np.dtype(WIRE_FORMATS[header.dtype]):
            raise ChunkError(f"chunk {header.chunk} of iteration {header.iteration} from node {header.origin}: "
                             f"payload of {payload.size} {payload.dtype}, header says {header.count} "
                             f"{header.dtype}")
        if header.dtype == "int32" and payload.size and int(np.max(np.abs(payload.astype(np.int64)))) > INT_EXACT:
            raise ChunkError(f"chunk {header.chunk} of iteration {header.iteration} from node {header.origin}: "
                             f"integer beyond 2**24, the exact range")

    def _forward(self, header: ChunkHeader, payload: np.ndarray) -> Send:
        """An auxiliary chunk passing through: follow the source's path, whatever our own policy says."""
        if not header.is_aux:
            raise ChunkError(f"node {self.node_id} received chunk {header.chunk} of iteration {header.iteration} "
                             f"for node {header.final} without an auxiliary path")
        try:
            position = header.path.index(self.node_id)
        except ValueError:
            raise ChunkError(f"auxiliary chunk with path {header.path} reached node {self.node_id}, not on it") \
                from None
        if position == len(header.path) - 1:
            raise ChunkError(f"auxiliary path {header.path} ends here but final is {header.final}")
        return Send(header.hop(self.node_id, header.path[position + 1], 0.0), payload)

    def _deliver(self, state: _Iteration, header: ChunkHeader, payload: np.ndarray) -> list[Action]:
        """A chunk that completed its tree edge at this node, with the iteration's policy bound."""
        policy = state.policy
        assert policy is not None
        layout = self._need_layout()
        index = header.chunk
        where = (f"chunk {index} of iteration {state.number} from node {header.origin} "
                 f"({header.phase.name}, root {header.root})")
        if header.version != policy.version:
            raise ChunkError(f"{where}: policy version {header.version}, iteration is bound to {policy.version}")
        root = state.roots[index]
        if header.root != root:
            raise ChunkError(f"{where}: policy version {policy.version} allots this chunk to root {root}")
        tree = policy.trees[root]
        chunk = layout.chunks[index]
        span = slice(chunk.offset, chunk.stop)
        if header.phase is Phase.UP:
            if tree.parent.get(header.origin) != self.node_id:
                raise ChunkError(f"{where}: node {header.origin} is not a child of node {self.node_id} in the "
                                 f"tree of root {root}")
            if header.origin in state.arrived[index]:
                raise ChunkError(f"{where}: duplicate contribution")
            if state.sent_up[index]:
                raise ChunkError(f"{where}: arrived after the partial sum left")
            state.arrived[index].add(header.origin)
            target = self._sums(state, chunk)[:header.count]
            np.add(target, _values(header, payload), out=target, casting="unsafe")
            return self._advance(state, index)
        if tree.parent.get(self.node_id) != header.origin:
            raise ChunkError(f"{where}: node {header.origin} is not the parent of node {self.node_id}")
        if state.done[index]:
            raise ChunkError(f"{where}: duplicate result")
        if not state.sent_up[index]:
            raise ChunkError(f"{where}: result before this node's partial sum left")
        state.acc[span.start + header.count:span.stop] = 0
        state.acc[span.start:span.start + header.count] = _values(header, payload)
        return self._complete(state, index, payload, header.count, header.dtype)

    def _advance(self, state: _Iteration, index: int) -> list[Action]:
        """Send the partial sum up (or, at the root, the full sum down) if the chunk is ready."""
        if (state.sent_up[index] or state.local_missing[index] > 0 or state.policy is None
                or state.number in self._closed):
            return []
        root = state.roots[index]
        tree = state.policy.trees[root]
        if len(state.arrived[index]) < len(tree.children(self.node_id)):
            return []
        state.sent_up[index] = True
        chunk = self._need_layout().chunks[index]
        if self.node_id == root:
            self._threshold(state, chunk)
        try:
            payload, values, dtype = self._outgoing(state, chunk)
        except ChunkError as exc:
            return self.fail(state.number, str(exc))
        if self.node_id == root:
            # the root keeps what it sends down (rounded to float16, or the integer sum), so every DC
            # holds the same result
            if values.dtype != np.float32 or values.size != chunk.count:
                state.acc[chunk.offset + values.size:chunk.stop] = 0
                state.acc[chunk.offset:chunk.offset + values.size] = values
            return self._complete(state, index, payload, values.size, dtype)
        parent = tree.parent[self.node_id]
        assert parent is not None
        return [Send(self._header(state, index, Phase.UP, parent, values.size, dtype), payload)]

    def _complete(self, state: _Iteration, index: int, payload: np.ndarray, count: int,
                  dtype: WireDtype) -> list[Action]:
        """The chunk holds the full sum here: pass it to the children, account for keys and iteration."""
        policy = state.policy
        assert policy is not None
        state.done[index] = True
        state.chunks_left -= 1
        tree = policy.trees[state.roots[index]]
        actions: list[Action] = [Send(self._header(state, index, Phase.DOWN, child, count, dtype), payload)
                                 for child in tree.children(self.node_id)]
        chunk = self._need_layout().chunks[index]
        for key in range(chunk.first_key, chunk.last_key + 1):
            state.key_remaining[key] -= 1
            if state.key_remaining[key] == 0:
                actions.append(KeyDone(state.number, key))
        if state.chunks_left == 0:
            actions.append(IterationDone(state.number))
        return actions

    def _header(self, state: _Iteration, index: int, phase: Phase, dst: int, count: int,
                dtype: WireDtype) -> ChunkHeader:
        policy = state.policy
        assert policy is not None
        return ChunkHeader(iteration=state.number, chunk=index, root=state.roots[index], phase=phase,
                           src=self.node_id, dst=dst, origin=self.node_id, final=dst, version=policy.version,
                           t_send=0.0, is_aux=False, path=(self.node_id, dst), count=count, dtype=dtype)

    def _threshold(self, state: _Iteration, chunk: Chunk) -> None:
        """At the root the counts are full: where the chunk holds the GIA tensor, keep 1 where a count
        reaches the threshold and 0 elsewhere, so the GIA goes down the tree as a bitmap."""
        layout = self._need_layout()
        if layout.gia_key < 0 or not chunk.first_key <= layout.gia_key <= chunk.last_key:
            return
        span = layout.key_slice(layout.gia_key)
        start, stop = max(span.start, chunk.offset), min(span.stop, chunk.stop)
        counts = state.ints[start - layout.int_start:stop - layout.int_start]
        counts[:] = counts >= layout.gia_threshold

    def _sums(self, state: _Iteration, chunk: Chunk) -> np.ndarray:
        """Where chunk ``chunk``'s sum accumulates: its span of the float32 or the int32 vector."""
        if chunk.dtype == "float32":
            return state.acc[chunk.offset:chunk.stop]
        start = chunk.offset - self._need_layout().int_start
        return state.ints[start:start + chunk.count]

    def _outgoing(self, state: _Iteration, chunk: Chunk) -> tuple[np.ndarray, np.ndarray, WireDtype]:
        """The chunk's partial (or full) sum as it goes on the wire: (payload, the values it stands for,
        wire dtype). The all-zero tail is elided; an integer sum travels in the narrowest dtype holding
        it (0/1 sums as bits); ChunkError beyond the exact range."""
        sums = self._sums(state, chunk)
        sums = sums[:_extent(sums)]
        if chunk.dtype == "float32":
            if self._need_layout().float_wire == "float16" and sums.size:
                with np.errstate(over="ignore"):
                    half = sums.astype(np.float16)
                if bool(np.isfinite(half).all()) or not bool(np.isfinite(sums).all()):
                    return half, half, "float16"
            return sums, sums, "float32"
        if not sums.size:
            return sums.astype(np.uint8), sums, "uint8"
        low, high = int(sums.min()), int(sums.max())
        if max(-low, high) > INT_EXACT:
            raise ChunkError(f"chunk {chunk.index} of iteration {state.number}: an integer sum of magnitude "
                             f"{max(-low, high)} is beyond 2**24, the exact range")
        if low >= 0 and high <= 1:
            return np.packbits(sums != 0), sums, "bit"
        for dtype in _NARROWEST[low >= 0]:
            info = np.iinfo(dtype)
            if info.min <= low and high <= info.max:
                values = sums.astype(dtype)
                return values, values, _WIRE_NAMES[values.dtype]
        raise AssertionError("int32 holds every sum within 2**24")

_WIRE_NAMES: dict[np.dtype, WireDtype] = {np.dtype(fmt): name for name, fmt in WIRE_FORMATS.items()  # type: ignore[misc]
                                          if name != "bit"}
"""A payload's wire dtype name (looked up once: ``dtype.name`` costs a string build per frame)."""

_NARROWEST: dict[bool, tuple[str, ...]] = {
    True: ("uint8", "int16", "int32"),
    False: ("int8", "int16", "int32"),
}
"""The dtypes an integer partial sum may travel in, narrowest first, for sums without and with negatives."""


def _values(header: ChunkHeader, payload: np.ndarray) -> np.ndarray:
    """The values a payload carries (bits unpacked)."""
    return np.unpackbits(payload, count=header.count) if header.dtype == "bit" else payload


def _extent(values: np.ndarray) -> int:
    """One past the last nonzero element: what a frame must carry (the rest is zero)."""
    if not values.size or values[-1] != 0:
        return int(values.size)
    nonzero = np.flatnonzero(values)
    return int(nonzero[-1]) + 1 if nonzero.size else 0
