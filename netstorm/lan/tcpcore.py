"""The TCP path's protocol, sans I/O: ``TcpGatewayCore`` (frames in, frames and completions out) and the
worker's side (``encode_data``, ``ResultAssembly``).

The gateway sums every worker's DATA in int64 fixed point at the layout's scale, converting narrow lanes
exactly as the UDP paths do (``netstorm/lan/precision.py``: the value a lane stands for, times
``2**scale``, rounded half to even), and returns ``fixedpoint.dequantize`` of the sum: bit for bit the
numpy reference the UDP paths are checked against. int64 cannot overflow for 64 workers of lanes below
``MAX_WIDE``, so the TCP path needs no RESCALE round: a worker whose fp32 values do not fit int32 at the
scale sends that frame's lanes as int64 instead (``wide``).

TCP delivers in order and loses nothing, so a worker's frames of an iteration must arrive in layout order
(tensor by tensor, segment by segment); anything else is a protocol error that closes that worker's
connection, never a guess. Memory is bounded: at most ``WINDOW`` iterations' int64 sums are open, and a
frame that would open another is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from netstorm.lan import tcpwire
from netstorm.lan.errors import EdgeTimeout, WireError
from netstorm.lan.fixedpoint import dequantize
from netstorm.lan.header import Precision
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.precision import decode_lanes, encode_lanes, int8_scales
from netstorm.lan.tcpwire import Data, Frame, Hello, Refusal, Refused, Result, Welcome
from netstorm.lan.tokens import LanTokens, Sender

WINDOW = 4
"""Iterations whose sums the gateway keeps open at once (a synchronous worker is at most one ahead)."""
NONCES = 4096
"""HELLO nonces remembered (a replayed HELLO is refused); the set is cleared when full."""


class Refuse(WireError):
    """A frame the gateway will not take: the connection is closed with this ``code`` and message."""

    def __init__(self, code: Refused, message: str) -> None:
        super().__init__(message)
        self.reason = code


@dataclasses.dataclass(frozen=True)
class Send:
    """Write ``header`` then ``payload`` (possibly empty) on connection ``conn``."""

    conn: int
    header: bytes
    payload: memoryview | bytes = b""


@dataclasses.dataclass(frozen=True)
class Completed:
    """Every expected worker's DATA of ``iteration`` has been summed: ``take(iteration)`` has its sums."""

    iteration: int


def to_fixed(head: Data, payload: memoryview, lanes: int, scale: int) -> np.ndarray:
    """A DATA frame's lanes as int64 fixed point at ``scale``, the UDP aggregators' conversion; Refuse when
    a lane stands for no finite value or one beyond ``MAX_WIDE`` at the scale."""
    precision = Precision(head.precision)
    if precision == Precision.FIXED32:
        raw = np.frombuffer(payload, "<i8" if head.wide else "<i4")
        if head.wide and not np.all(np.abs(raw) < tcpwire.MAX_WIDE):
            raise Refuse(Refused.MALFORMED, "wide lanes beyond the fixed-point bound")
        return raw
    if precision == Precision.INT8:
        chunks = -(-head.count // lanes)
        wscales = np.frombuffer(payload, "i1", chunks).astype(np.int64)
        matrix = np.zeros(chunks * lanes, "i1")
        matrix[: head.count] = np.frombuffer(payload, "i1", head.count, chunks)
        values = decode_lanes(matrix.reshape(chunks, lanes), precision, wscales).reshape(-1)[: head.count]
    else:
        values = decode_lanes(np.frombuffer(payload, "<u2"), precision, np.zeros(0))
    scaled = values * 2.0**scale
    if not np.all(np.abs(scaled) < tcpwire.MAX_WIDE):   # false for nan and inf too
        raise Refuse(Refused.MALFORMED, f"{precision.name} lanes beyond fixed point at scale {scale} (or inf/nan)")
    return np.rint(scaled).astype(np.int64)


def encode_data(values: np.ndarray, precision: Precision, scale: int, lanes: int) -> tuple[bytes | memoryview, bool]:
    """One frame's payload for a worker's float32 ``values`` (a chunk-aligned segment) and its ``wide``
    flag: what ``to_fixed`` turns back into the lanes the UDP paths would have summed."""
    if precision == Precision.FIXED32:
        fixed, wide = tcpwire.fixed_lanes(values, scale)
        return fixed.data.cast("B"), wide
    chunks = -(-values.size // lanes)
    matrix = np.zeros((chunks, lanes), np.float64)
    matrix.reshape(-1)[: values.size] = values
    if not np.all(np.isfinite(matrix)):
        raise WireError("gradient contains inf or nan; it cannot be aggregated in fixed point")
    wscales = int8_scales(matrix) if precision == Precision.INT8 else np.zeros(chunks, np.int64)
    encoded = encode_lanes(matrix, precision, wscales).reshape(-1)[: values.size]
    if precision == Precision.INT8:
        return wscales.astype("i1").tobytes() + encoded.tobytes(), False
    return encoded.tobytes(), False


@dataclasses.dataclass(frozen=True)
class Summed:
    """Every expected worker's DATA of ``iteration`` has been summed up to LAN chunk ``upto`` (a sequence
    number of the layout; from ``since``): those chunks' sums are final (``partial``)."""

    iteration: int
    since: int
    upto: int


@dataclasses.dataclass
class _Iteration:
    sums: list[np.ndarray]
    position: dict[int, tuple[int, int]]
    """Per worker that began, its next (tensor, offset)."""
    done: set[int]
    bursts: dict[int, list[float]]
    """Per worker: [bytes, first, last] of its DATA (the uplink meter's input)."""
    frontier: int = 0
    """LAN chunks (sequence numbers) below this hold every worker's DATA: workers send in layout order."""


class TcpGatewayCore:
    """The gateway's side of the TCP path for one layout and ``workers`` workers (ids 0..workers-1)."""

    def __init__(self, layout: EdgeLayout, *, workers: int, job: int, secret: bytes | None = None) -> None:
        if len(layout.sizes) > tcpwire.MAX_TENSORS:
            raise WireError(f"the TCP path carries up to {tcpwire.MAX_TENSORS} tensors, the model has "
                            f"{len(layout.sizes)}")
        self.layout = layout
        self.workers = workers
        self.job = job
        self.tokens = LanTokens(secret, job)
        self.segment = tcpwire.SEGMENT_CHUNKS * layout.lanes
        self.max_payload = self.segment * 8
        self.worker_of: dict[int, int] = {}
        """Connection -> the worker its HELLO proved."""
        self.conn_of: dict[int, int] = {}
        self._nonces: set[int] = set()
        self._open: dict[int, _Iteration] = {}
        self._ready: dict[int, list[np.ndarray]] = {}
        self._summed: dict[int, _Iteration] = {}
        """The newest completed iterations' int64 sums, for ``partial`` after ``take``."""
        self._last_bursts: tuple[int, dict[int, list[float]]] | None = None
        self.refused = 0
        """Connections closed for a malformed, forged or out-of-order frame."""

    # --- connections -------------------------------------------------------------------------------

    def expect(self, conn: int, message: Frame, payload_len: int) -> None:
        """Check a header before its payload is read (``FrameReader.expect``); Refuse when it is not
        acceptable on this connection now."""
        worker = self.worker_of.get(conn)
        if isinstance(message, Hello):
            if worker is not None:
                raise Refuse(Refused.PROTOCOL, f"a second HELLO on worker {worker}'s connection")
            if payload_len:
                raise Refuse(Refused.MALFORMED, "HELLO carries no payload")
            return
        if not isinstance(message, Data):
            raise Refuse(Refused.PROTOCOL, f"a worker sends HELLO and DATA, not {type(message).__name__}")
        if worker is None:
            raise Refuse(Refused.PROTOCOL, "DATA before HELLO")
        if message.worker != worker:
            raise Refuse(Refused.FORGED, f"DATA naming worker {message.worker} on worker {worker}'s connection")
        if not self.tokens.valid(Sender.WORKER, worker, message.iteration, message.token):
            raise Refuse(Refused.FORGED, f"worker {worker}'s DATA of iteration {message.iteration} carries a "
                                         f"token that is not its own")
        state = self._open.get(message.iteration)
        if state is None and (message.iteration in self._ready or len(self._open) >= WINDOW):
            raise Refuse(Refused.PROTOCOL, f"iteration {message.iteration} is not open (open: {sorted(self._open)})")
        at = state.position.get(worker, (0, 0)) if state is not None else (0, 0)
        if state is not None and worker in state.done:
            raise Refuse(Refused.PROTOCOL, f"worker {worker} sent iteration {message.iteration} twice")
        tensor, offset = at
        if (message.tensor, message.offset) != at or message.count != min(self.segment,
                                                                           self.layout.sizes[tensor] - offset):
            raise Refuse(Refused.PROTOCOL, f"worker {worker}'s DATA of iteration {message.iteration} covers "
                                           f"tensor {message.tensor} [{message.offset}, +{message.count}); expected "
                                           f"tensor {tensor} from {offset}")
        if payload_len != message.payload_bytes(self.layout.lanes):
            raise Refuse(Refused.MALFORMED, f"DATA payload of {payload_len} bytes; its header says "
                                            f"{message.payload_bytes(self.layout.lanes)}")

    def on_frame(self, conn: int, message: Frame, payload: memoryview,
                 now: float) -> list[Send | Completed | Summed]:
        """A frame ``expect`` accepted, with its payload."""
        if isinstance(message, Hello):
            return self._hello(conn, message)
        assert isinstance(message, Data)
        return self._data(message, payload, now)

    def refuse(self, conn: int, error: WireError) -> Send:
        """The REFUSAL to write before closing ``conn`` for ``error``."""
        self.refused += 1
        code = error.reason if isinstance(error, Refuse) else Refused.MALFORMED
        return Send(conn, tcpwire.encode(Refusal(code, str(error)[:4096])))

    def closed(self, conn: int) -> None:
        worker = self.worker_of.pop(conn, None)
        if worker is not None and self.conn_of.get(worker) == conn:
            del self.conn_of[worker]
        # a partial contribution already summed cannot be taken back: a worker that reconnects within an
        # iteration it had begun is refused for it (out of order), and the iteration times out naming it

    def _hello(self, conn: int, hello: Hello) -> list[Send | Completed | Summed]:
        if hello.job != self.job:
            raise Refuse(Refused.PROTOCOL, f"HELLO of job {hello.job}; this gateway serves job {self.job}")
        if hello.worker >= self.workers:
            raise Refuse(Refused.PROTOCOL, f"worker {hello.worker}: this LAN has workers 0..{self.workers - 1}")
        if not self.tokens.valid(Sender.WORKER, hello.worker, hello.nonce, hello.token, keep=False):
            raise Refuse(Refused.FORGED, f"HELLO of worker {hello.worker} without its token")
        if self.tokens.enabled and hello.nonce in self._nonces:
            raise Refuse(Refused.FORGED, f"HELLO of worker {hello.worker} replays nonce {hello.nonce}")
        if tuple(hello.sizes) != self.layout.sizes:
            raise Refuse(Refused.PROTOCOL, f"worker {hello.worker}'s model has tensors of {list(hello.sizes)} "
                                           f"elements, the gateway's {list(self.layout.sizes)}")
        if len(self._nonces) >= NONCES:
            self._nonces.clear()
        self._nonces.add(hello.nonce)
        old = self.conn_of.get(hello.worker)
        if old is not None:   # a restarted worker: the newer connection wins, the old one is forgotten
            self.closed(old)
        self.worker_of[conn] = hello.worker
        self.conn_of[hello.worker] = conn
        welcome = Welcome(hello.worker, hello.nonce, self.tokens.of(Sender.GATEWAY, hello.worker, hello.nonce,
                                                                    keep=False),
                          self.layout.scales, self.layout.lanes, self.segment)
        return [Send(conn, tcpwire.encode(welcome))]

    def _progress(self, iteration: int, state: _Iteration) -> list[Summed]:
        """The chunks every worker's DATA now covers (frames start on chunk boundaries), if that moved."""
        layout = self.layout
        frontier = layout.num_chunks
        for w in range(self.workers):
            if w in state.done:
                continue
            tensor, offset = state.position.get(w, (0, 0))
            frontier = min(frontier, layout.first_slot[tensor] + offset // layout.lanes)
        if frontier <= state.frontier:
            return []
        since, state.frontier = state.frontier, frontier
        return [Summed(iteration, since, frontier)]

    def frontier(self, iteration: int) -> int:
        """LAN chunks of ``iteration`` below this sequence number are summed (0: none yet)."""
        state = self._open.get(iteration) or self._summed.get(iteration)
        return 0 if state is None else state.frontier

    def partial(self, iteration: int, tensor: int, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of ``tensor``'s LAN sum of ``iteration``, every worker's DATA there
        summed (a ``Summed`` said so): exactly what the whole sum holds there. KeyError once the iteration
        was taken or dropped."""
        state = self._open.get(iteration) or self._summed[iteration]
        if self.layout.first_slot[tensor] + -(-stop // self.layout.lanes) > state.frontier:
            raise ValueError(f"iteration {iteration} tensor {tensor} [{start}, {stop}) is not summed yet")
        return dequantize(state.sums[tensor][start:stop], self.layout.scales[tensor])

    def _data(self, head: Data, payload: memoryview, now: float) -> list[Send | Completed | Summed]:
        state = self._open.get(head.iteration)
        if state is None:
            state = self._open[head.iteration] = _Iteration(
                [np.zeros(s, np.int64) for s in self.layout.sizes], {}, set(), {})
        fixed = to_fixed(head, payload, self.layout.lanes, self.layout.scales[head.tensor])
        target = state.sums[head.tensor][head.offset: head.offset + head.count]
        np.add(target, fixed, out=target)
        burst = state.bursts.setdefault(head.worker, [0.0, now, now])
        burst[0] += payload.nbytes
        burst[2] = now
        offset = head.offset + head.count
        tensor = head.tensor
        if offset >= self.layout.sizes[tensor]:
            tensor, offset = tensor + 1, 0
        if tensor == len(self.layout.sizes):
            state.done.add(head.worker)
            state.position.pop(head.worker, None)
            if len(state.done) == self.workers:
                summed = self._progress(head.iteration, state)
                del self._open[head.iteration]
                self._summed[head.iteration] = state
                for old in sorted(self._summed)[:-WINDOW]:
                    del self._summed[old]
                self._ready[head.iteration] = [dequantize(s, scale) for s, scale in
                                               zip(state.sums, self.layout.scales, strict=True)]
                self._last_bursts = (head.iteration, state.bursts)
                return [*summed, Completed(head.iteration)]
        else:
            state.position[head.worker] = (tensor, offset)
        return list(self._progress(head.iteration, state))

    # --- iterations --------------------------------------------------------------------------------

    def ready(self, iteration: int) -> bool:
        return iteration in self._ready

    def take(self, iteration: int) -> list[np.ndarray]:
        """The LAN sums of a completed iteration (float32, one per tensor), handed over once."""
        return self._ready.pop(iteration)

    def missing(self, iteration: int) -> list[int]:
        state = self._open.get(iteration)
        return [w for w in range(self.workers) if state is None or w not in state.done]

    def timed_out(self, iteration: int, timeout: float) -> EdgeTimeout:
        """The error of an iteration that did not complete, naming its missing workers; its partial sums
        are dropped so the window stays bounded."""
        missing = self.missing(iteration)
        self._open.pop(iteration, None)
        silent = [w for w in missing if w not in self.conn_of]
        return EdgeTimeout(f"edge (tcp): iteration {iteration} incomplete after {timeout} s: missing workers "
                           f"{missing}" + (f" ({silent} not connected)" if silent else ""))

    def uplink_bursts(self, iteration: int) -> list[tuple[int, int, float, float]]:
        last = self._last_bursts
        if last is None or last[0] != iteration:
            return []
        return [(w, int(b[0]), b[1], b[2]) for w, b in sorted(last[1].items())]

    def results(self, iteration: int, results: Sequence[np.ndarray], *, total: int) -> list[Send]:
        """RESULT frames of ``iteration`` for every connected worker: one header per worker and frame, the
        payloads views of ``results`` shared by all."""
        if len(results) != len(self.layout.sizes):
            raise ValueError(f"{len(results)} result tensors for a layout of {len(self.layout.sizes)}")
        flats = [np.ascontiguousarray(r, np.float32).reshape(-1) for r in results]
        out = []
        for worker, conn in sorted(self.conn_of.items()):
            token = self.tokens.gateway(worker, iteration)
            for t, flat in enumerate(flats):
                if flat.size != self.layout.sizes[t]:
                    raise ValueError(f"result tensor {t} has {flat.size} elements, the layout {self.layout.sizes[t]}")
                for offset, count in tcpwire.frame_bounds(flat.size, self.segment):
                    head = Result(worker, iteration & 0xFFFFFFFF, t, offset, count, total, token)
                    out.append(Send(conn, tcpwire.encode(head, count * 4),
                                    flat[offset: offset + count].data.cast("B")))
        return out


class ResultAssembly:
    """A worker's side of one iteration's results: each RESULT frame's payload is received straight into
    its place in per-tensor float32 arrays (``target``), and ``done`` once every element arrived."""

    def __init__(self, sizes: Sequence[int], segment: int, tokens: LanTokens, worker: int) -> None:
        self.sizes = tuple(sizes)
        self.segment = segment
        self.tokens = tokens
        self.worker = worker
        self.iteration: int | None = None
        self.arrays: list[np.ndarray] = []
        self._next = (0, 0)
        self._left = 0
        self.total = 0

    @property
    def complete(self) -> bool:
        return self._left == 0 and self.iteration is not None

    def begin(self, iteration: int | None) -> None:
        """Expect ``iteration``'s result (None: the first result that comes, whatever its iteration)."""
        self.iteration = iteration
        self.arrays = [np.empty(s, np.float32) for s in self.sizes]
        self._next = (0, 0)
        self._left = len(self.sizes)

    def target(self, head: Result, payload_len: int) -> memoryview:
        """Where ``head``'s payload goes; WireError for a result this worker did not ask for or a forgery."""
        if self.iteration is None and (head.tensor, head.offset) == (0, 0) and self._left:
            self.iteration = head.iteration
        if self.iteration is None or head.iteration != self.iteration & 0xFFFFFFFF:
            raise WireError(f"edge worker {self.worker}: RESULT of iteration {head.iteration}, waiting for "
                            f"{self.iteration}")
        if head.worker != self.worker or not self.tokens.valid(Sender.GATEWAY, self.worker, head.iteration,
                                                               head.token):
            raise WireError(f"edge worker {self.worker}: a RESULT without the gateway's token for this worker")
        tensor, offset = self._next
        due = min(self.segment, self.sizes[tensor] - offset)
        if (head.tensor, head.offset) != (tensor, offset) or head.count != due:
            raise WireError(f"edge worker {self.worker}: RESULT of tensor {head.tensor} [{head.offset}, "
                            f"+{head.count}) where tensor {tensor} from {offset} was due")
        if payload_len != head.count * 4:
            raise WireError(f"edge worker {self.worker}: RESULT payload of {payload_len} bytes for {head.count} "
                            f"float32 values")
        return self.arrays[tensor][offset: offset + head.count].data.cast("B")

    def received(self, head: Result) -> bool:
        """The payload of ``head`` is in place; True once the iteration's result is whole."""
        self.total = head.total
        offset = head.offset + head.count
        tensor = head.tensor
        if offset >= self.sizes[tensor]:
            tensor, offset = tensor + 1, 0
            self._left -= 1
        self._next = (tensor, offset)
        return self._left == 0
