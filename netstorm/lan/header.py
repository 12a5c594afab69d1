"""The LAN edge wire format: one UDP datagram = a 32-byte header + up to ``MAX_LANES`` 4-byte lanes.

All fields are little-endian (the XDP program adds lanes in host order on x86/arm64 without swaps):

====== ====== ============ =====================================================================
offset size   field        meaning
====== ====== ============ =====================================================================
0      u16    magic        0x534E ("NS")
2      u8     version      1
3      u8     kind         DATA, AGG, NACK, RESULT, PULL, HELLO (see ``Kind``)
4      u16    job          training job; the gateway ignores other jobs' packets
6      u8     worker       LAN worker id, 0..63 (bit in the contributor bitmap)
7      u8     flags        OVERFLOW (lane sum or own value out of int32 range), RESCALE (on a NACK)
8      u32    iteration    synchronous iteration number (wraps; compared as a signed difference)
12     u32    tensor       tensor index in the job's layout
16     u32    chunk        packet-sized chunk of that tensor
20     u32    slot         aggregation slot chosen by the layout, < the slot map's size
24     u16    count        lanes in this datagram, <= MAX_LANES
26     i8     scale        lanes hold round(x * 2**scale) (DATA/AGG) or float32 values (RESULT)
27     i8     need         largest scale at which the sender's values fit int32 (AGG: min over workers)
28     u32    total        RESULT: workers whose gradients the result sums (every DC's trainer and
                           LAN workers, what ``average=True`` divides by; 0 from a gateway that
                           predates the field); zero in every other kind
====== ====== ============ =====================================================================

DATA and AGG carry int32 fixed-point lanes; RESULT carries float32 lanes. DATA is always padded with zero
lanes to the layout's lane width (the XDP program then runs fixed-trip loops the verifier accepts in linear
time); ``count`` says how many lanes matter. 32 + 360*4 bytes of UDP payload plus 28 bytes of IPv4/UDP
headers is exactly a 1500-byte MTU.

The XDP program (bpf/aggregator.c) never reads ``total``: DATA carries zero there and AGG keeps it. Only the
loader's own TIMER_INIT frames (bpf/xdp.py), which never leave the host, use that word, to read back an errno.
"""

from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass
from typing import Final

import numpy as np

from netstorm.errors import NetStormError

MAGIC: Final = 0x534E
VERSION: Final = 1
HEADER_BYTES: Final = 32
MAX_LANES: Final = 360
MAX_WORKERS: Final = 64
INT32_MAX: Final = 2**31 - 1
NEED_NONE: Final = 127
"""``need`` of an all-zero chunk: it fits at any scale."""


class WireError(NetStormError):
    """A datagram is not a valid edge packet; the message says which field is wrong."""


class EdgeTimeout(NetStormError):
    """A slot or an iteration did not complete in time; the message names the workers that were missing."""


class Kind(enum.IntEnum):
    DATA = 1
    """worker -> gateway: fixed-point contribution."""
    AGG = 2
    """gateway data plane -> gateway agent: the completed fixed-point sum of a slot."""
    NACK = 3
    """agent -> worker: resend (iteration, tensor, chunk); with RESCALE, re-quantise at ``scale`` first."""
    RESULT = 4
    """agent -> worker: float32 result of the WAN step for one chunk."""
    PULL = 5
    """worker -> agent: resend the RESULT of (iteration, tensor, chunk)."""
    HELLO = 6
    """worker -> agent: announces the worker's address; the agent answers with a HELLO."""


class Flag(enum.IntFlag):
    NONE = 0
    OVERFLOW = 1
    RESCALE = 2


_KINDS: Final = {int(k): k for k in Kind}
_FLAGS: Final = {int(f): Flag(f) for f in range(4)}
"""Decoding looks kinds and flags up instead of constructing enums: it runs once per datagram."""

HEADER_DTYPE: Final = np.dtype(
    [
        ("magic", "<u2"), ("version", "u1"), ("kind", "u1"), ("job", "<u2"), ("worker", "u1"), ("flags", "u1"),
        ("iteration", "<u4"), ("tensor", "<u4"), ("chunk", "<u4"), ("slot", "<u4"), ("count", "<u2"),
        ("scale", "i1"), ("need", "i1"), ("total", "<u4"),
    ]
)
HEADER_STRUCT: Final = struct.Struct("<HBBHBBIIIIHbbI")
assert HEADER_DTYPE.itemsize == HEADER_STRUCT.size == HEADER_BYTES


@dataclass(frozen=True, slots=True)
class Header:
    kind: Kind
    job: int
    worker: int
    iteration: int
    tensor: int
    chunk: int
    slot: int
    count: int
    scale: int
    need: int = NEED_NONE
    flags: Flag = Flag.NONE
    total: int = 0
    """RESULT only: workers whose gradients the result sums."""

    def encode(self) -> bytes:
        return HEADER_STRUCT.pack(MAGIC, VERSION, int(self.kind), self.job, self.worker, int(self.flags),
                                  self.iteration, self.tensor, self.chunk, self.slot, self.count, self.scale,
                                  self.need, self.total)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> Header:
        """The header of ``data``; raises WireError for a short, foreign or inconsistent datagram."""
        if len(data) < HEADER_BYTES:
            raise WireError(f"datagram of {len(data)} bytes is shorter than the {HEADER_BYTES}-byte header")
        (magic, version, kind_code, job, worker, flags, iteration, tensor, chunk, slot, count, scale, need,
         total) = HEADER_STRUCT.unpack_from(data)
        if magic != MAGIC:
            raise WireError(f"bad magic 0x{magic:04x}")
        if version != VERSION:
            raise WireError(f"unsupported version {version} (this side speaks {VERSION})")
        kind = _KINDS.get(kind_code)
        if kind is None:
            raise WireError(f"unknown kind {kind_code}")
        if count > MAX_LANES:
            raise WireError(f"count {count} exceeds {MAX_LANES} lanes")
        if worker >= MAX_WORKERS:
            raise WireError(f"worker {worker} out of range 0..{MAX_WORKERS - 1}")
        payload = len(data) - HEADER_BYTES
        if kind in (Kind.DATA, Kind.AGG, Kind.RESULT):
            # lanes may be padded (with zeros) up to the layout's lane width; count says how many matter
            if payload % 4 or not 4 * count <= payload <= 4 * MAX_LANES:
                raise WireError(f"{kind.name} datagram with {payload} payload bytes cannot hold {count} lanes")
        elif payload:
            raise WireError(f"{kind.name} datagram carries {payload} unexpected payload bytes")
        flag = _FLAGS.get(flags)
        if flag is None:
            raise WireError(f"unknown flags 0x{flags:02x}")
        if total and kind != Kind.RESULT:
            raise WireError(f"{kind.name} datagram with total {total}: only RESULT carries one")
        return cls(kind=kind, job=job, worker=worker, iteration=iteration, tensor=tensor, chunk=chunk, slot=slot,
                   count=count, scale=scale, need=need, flags=flag, total=total)


def lanes_of(data: bytes | bytearray | memoryview, dtype: str = "<i4") -> np.ndarray:
    """The payload lanes of a datagram as a read-only view (int32 for DATA/AGG, float32 for RESULT)."""
    return np.frombuffer(data, dtype, offset=HEADER_BYTES)


def fit_scale(values: np.ndarray) -> int:
    """The largest power-of-two scale at which every value rounds into int32 (NEED_NONE for all zeros)."""
    peak = float(np.max(np.abs(values), initial=0.0))
    if peak == 0.0:
        return NEED_NONE
    if not math.isfinite(peak):
        raise WireError("gradient contains inf or nan; it cannot be aggregated in fixed point")
    # round(peak * 2**s) <= INT32_MAX  <=  peak * 2**s <= 2**31 - 1
    scale = math.floor(math.log2(INT32_MAX / peak))
    while scale > -128 and np.rint(peak * 2.0**scale) > INT32_MAX:
        scale -= 1
    return max(-128, min(NEED_NONE - 1, scale))


def quantize(values: np.ndarray, scale: int) -> tuple[np.ndarray, bool]:
    """``values`` as int32 lanes ``rint(x * 2**scale)`` and whether any value fell outside int32 (clipped)."""
    scaled = np.rint(np.asarray(values, np.float64) * 2.0**scale)
    overflow = bool(np.any(np.abs(scaled) > INT32_MAX))
    if overflow:
        np.clip(scaled, -INT32_MAX, INT32_MAX, out=scaled)
    return scaled.astype("<i4"), overflow


def dequantize(sums: np.ndarray, scale: int) -> np.ndarray:
    """Fixed-point sums back to float32: exact int64 sum times 2**-scale, rounded once."""
    return (np.asarray(sums, np.float64) * 2.0**-scale).astype(np.float32)


def rescale_for(need: int, workers: int) -> int:
    """A scale at which ``workers`` values that each fit at ``need`` cannot overflow when summed."""
    return need - max(0, math.ceil(math.log2(max(1, workers))))
