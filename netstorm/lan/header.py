"""The LAN edge wire format: one UDP datagram = a 44-byte header + up to ``MAX_LANES`` lanes.

See docs/ARCHITECTURE.md, *Wires*."""

from __future__ import annotations

import enum
import itertools
import struct
from dataclasses import dataclass
from typing import Final

import numpy as np

from netstorm.lan.errors import WireError
from netstorm.lan.kinds import LANED_KINDS as LANED_KINDS
from netstorm.lan.kinds import LOADER_KINDS, MAX_PAYLOAD, NAMES
from netstorm.lan.kinds import MAX_DEPLOY_BYTES as MAX_DEPLOY_BYTES
from netstorm.lan.kinds import MAX_REPORT_BYTES as MAX_REPORT_BYTES
from netstorm.lan.kinds import Kind as Kind

MAGIC: Final = 0x534E
"""``"NS"`` in the first two bytes."""
VERSION: Final = 7
"""7: RESULT may carry the aggregate's own fixed-point lanes (SCALED32), which the aggregation program sends
when it returns results from the kernel, and the HELLO answer says so (``Deployment.kernel_results``);
6: the last header word is the LAN deployment ``epoch`` (it was reserved, zero), and the MOVED kind;
5: a NACK lists the chunks it asks for as u32 sequence numbers in its lanes (a RESCALE NACK still names one
chunk in its header and carries no lanes); 4: RESULT may carry narrow integer or bitmap lanes (``precision``),
and the REPORT and FAILED kinds; 3:
``precision`` and ``wscale`` joined the header, and slots became a pool (2 added the ``token``)."""
HEADER_BYTES: Final = 44
MAX_LANES: Final = 1024
"""The wire's limit; a layout's lane width comes from the LAN MTU (``lanes_for_mtu``)."""
IP_UDP_BYTES: Final = 28
MAX_WORKERS: Final = 64
"""Worker ids are bits of a 64-bit contributor bitmap."""
NEED_NONE: Final = 127
"""``need`` of an all-zero chunk: it fits at any scale."""


@dataclass(frozen=True)
class Field:
    """One header field: its name (the same in Python and C), C type and meaning."""

    name: str
    ctype: str
    meaning: str


FIELDS: Final = (
    Field("magic", "u16", "0x534E (MAGIC)"),
    Field("version", "u8", "VERSION"),
    Field("kind", "u8", ", ".join(NAMES) + " (netstorm/lan/kinds.py)"),
    Field("job", "u16", "training job; the gateway ignores other jobs' packets"),
    Field("worker", "u8", "LAN worker id, 0..63 (bit in the contributor bitmap)"),
    Field("flags", "u8", "OVERFLOW (lane sum or own value out of int32 range), RESCALE (on a NACK)"),
    Field("iteration", "u32", "synchronous iteration number (wraps; compared as a signed difference)"),
    Field("tensor", "u32", "tensor index in the job's layout"),
    Field("chunk", "u32", "packet-sized chunk of that tensor"),
    Field("slot", "u32", "aggregation slot chosen by the layout, < the slot map's size"),
    Field("count", "u16", "lanes in this datagram, <= MAX_LANES"),
    Field("scale", "s8", "lanes hold round(x * 2**scale) (DATA/AGG, and RESULT at SCALED32) or float32 values "
          "(RESULT at FIXED32)"),
    Field("need", "s8", "largest scale at which the sender's values fit int32 (AGG: min over workers)"),
    Field("total", "u32", "RESULT: workers whose gradients the result sums (every DC's trainer and LAN "
          "workers, what average=True divides by; 0 from a gateway that predates the field); zero in "
          "every other kind"),
    Field("token", "u64", "keyed per-(sender, worker, iteration) token when the job has a secret, else 0; "
          "AGG: the agent's own value, written by the data plane"),
    Field("precision", "u8", "DATA: lane encoding (Precision: FIXED32, FP16, BF16, INT8); RESULT: FIXED32 "
          "(float32 lanes), INT8, INT16, INT32, BITMAP or SCALED32 (int32 fixed point at the header's scale); zero "
          "elsewhere"),
    Field("wscale", "s8", "DATA at INT8: the sender's own scale (lanes hold round(x * 2**wscale)); else 0"),
    Field("epoch", "u16", "the LAN deployment epoch (netstorm/lan/redeploy.py): DATA, the one its sender was told "
          "(an aggregator takes only its own); RESULT of k, the one iteration k + 1 runs under; MOVED and the "
          "HELLO answer, the current one; 0 or the current one elsewhere"),
)
"""The header, field by field in wire order, without padding."""

_CODES: Final = {"u8": ("B", "u1"), "s8": ("b", "i1"), "u16": ("H", "<u2"), "u32": ("I", "<u4"),
                  "u64": ("Q", "<u8")}
"""C type -> (struct code, numpy dtype), all little-endian."""

HEADER_STRUCT: Final = struct.Struct("<" + "".join(_CODES[f.ctype][0] for f in FIELDS))
HEADER_DTYPE: Final = np.dtype([(f.name, _CODES[f.ctype][1]) for f in FIELDS])
OFFSETS: Final = dict(zip((f.name for f in FIELDS),
                           itertools.accumulate((struct.calcsize(_CODES[f.ctype][0]) for f in FIELDS), initial=0),
                           strict=False))
"""Byte offset of every field (what the C struct's offsetof must say)."""
KIND_AT: Final = OFFSETS["kind"]
TOKEN_AT: Final = OFFSETS["token"]
"""Where the token sits: a sender sets it per recipient on rows built once for every worker."""
"""Where a receiver peeks at the kind before decoding the whole header."""
assert HEADER_DTYPE.itemsize == HEADER_STRUCT.size == HEADER_BYTES
assert all(HEADER_DTYPE.fields is not None and HEADER_DTYPE.fields[n][1] == at for n, at in OFFSETS.items())


class Precision(enum.IntEnum):
    """How a DATA datagram's lanes encode the sender's values; the aggregator converts each exactly to int32
    fixed point at the datagram's ``scale`` (the slot's common scale) before adding."""

    FIXED32 = 0
    """int32 lanes round(x * 2**scale), quantised by the sender (what an fp32 worker sends)."""
    FP16 = 1
    """IEEE half-precision bits (2 bytes)."""
    BF16 = 2
    """bfloat16 bits (2 bytes)."""
    INT8 = 3
    """int8 lanes round(x * 2**wscale) at the sender's own ``wscale`` (1 byte); on a RESULT, exact integers."""
    INT16 = 4
    """RESULT only: exact int16 integers (2 bytes)."""
    INT32 = 5
    """RESULT only: exact int32 integers (4 bytes)."""
    BITMAP = 6
    """RESULT only: 0/1 elements, 8 per byte lane (numpy ``packbits``, little bit order): a GIA."""
    SCALED32 = 7
    """RESULT only: exact int32 fixed-point sums at the header's ``scale`` (4 bytes), which the receiver
    turns into float32 as the agent would (``fixedpoint.dequantize_rows``): the aggregate itself, as the
    aggregation program emits it when it returns results from the kernel (``edge_results=kernel``)."""

    @property
    def lane_bytes(self) -> int:
        return LANE_BYTES[self]

    @classmethod
    def parse(cls, name: str) -> Precision:
        """``fp32``, ``fp16``, ``bf16`` or ``int8``."""
        try:
            return PRECISION_NAMES[name.strip().lower()]
        except KeyError:
            raise WireError(f"unknown precision {name!r}: expected one of {', '.join(PRECISION_NAMES)}") from None


LANE_BYTES: Final = {Precision.FIXED32: 4, Precision.FP16: 2, Precision.BF16: 2, Precision.INT8: 1,
                     Precision.INT16: 2, Precision.INT32: 4, Precision.BITMAP: 1, Precision.SCALED32: 4}
DATA_PRECISIONS: Final = (Precision.FIXED32, Precision.FP16, Precision.BF16, Precision.INT8)
"""How a DATA datagram's lanes may travel (what the aggregators widen to int32 fixed point)."""
RESULT_PRECISIONS: Final = (Precision.FIXED32, Precision.INT8, Precision.INT16, Precision.INT32, Precision.BITMAP,
                             Precision.SCALED32)
"""How a RESULT datagram's lanes may travel: float32 (FIXED32's code), a compressed job's integer round's
exact integers or bitmap (``netstorm/lan/resultwire.py``), or the aggregate's own fixed-point lanes
(SCALED32, a result the aggregation program sends itself)."""
PRECISION_NAMES: Final = {"fp32": Precision.FIXED32, "fp16": Precision.FP16, "bf16": Precision.BF16,
                          "int8": Precision.INT8}


def lanes_for_mtu(mtu: int) -> int:
    """The widest lane count whose int32/float32 datagram fits an ``mtu``-byte IPv4 packet (narrower lanes:
    ``lanes_for_bytes``), at most the wire's MAX_LANES: a jumbo MTU (9000) carries MAX_LANES lanes."""
    lanes = min(MAX_LANES, (mtu - IP_UDP_BYTES - HEADER_BYTES) // 4)
    if lanes < 1:
        raise WireError(f"an MTU of {mtu} bytes holds {lanes} lanes; the wire carries 1..{MAX_LANES}")
    return lanes


def lanes_for_bytes(payload: int, precision: Precision) -> int:
    """How many lanes of ``precision`` a datagram whose int32 payload is ``payload`` bytes carries in as many
    bytes (at most MAX_LANES)."""
    return max(1, min(MAX_LANES, payload // precision.lane_bytes))


class Flag(enum.IntFlag):
    NONE = 0
    OVERFLOW = 1
    RESCALE = 2
    AGGREGATOR = 4
    """On a HELLO: from a cluster aggregator's service (it gets its deployment; results still go to the
    worker's own HELLO address)."""


_KINDS: Final = {int(k): k for k in Kind}
_PRECISIONS: Final = {int(p): p for p in Precision}
_ALLOWED: Final = {Kind.DATA: frozenset(DATA_PRECISIONS), Kind.RESULT: frozenset(RESULT_PRECISIONS)}
"""Lane encodings each kind may carry (every other kind: FIXED32 only)."""
_FLAGS: Final = {int(f): Flag(f) for f in range(8)}
"""Decoding looks kinds and flags up instead of constructing enums: it runs once per datagram."""


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
    token: int = 0
    """The sender's token (netstorm/lan/tokens.py), 0 without a job secret."""
    precision: Precision = Precision.FIXED32
    wscale: int = 0
    epoch: int = 0
    """The LAN deployment epoch (see ``FIELDS``)."""

    def encode(self) -> bytes:
        return HEADER_STRUCT.pack(MAGIC, VERSION, int(self.kind), self.job, self.worker, int(self.flags),
                                  self.iteration, self.tensor, self.chunk, self.slot, self.count, self.scale,
                                  self.need, self.total, self.token, int(self.precision), self.wscale, self.epoch)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> Header:
        """The header of ``data``; raises WireError for a short, foreign or inconsistent datagram."""
        if len(data) < HEADER_BYTES:
            raise WireError(f"datagram of {len(data)} bytes is shorter than the {HEADER_BYTES}-byte header")
        (magic, version, kind_code, job, worker, flags, iteration, tensor, chunk, slot, count, scale, need,
         total, token, precision_code, wscale, epoch) = HEADER_STRUCT.unpack_from(data)
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
        precision = _PRECISIONS.get(precision_code)
        if precision is None or (precision != Precision.FIXED32 and precision not in _ALLOWED.get(kind, ())):
            raise WireError(f"{kind.name} datagram with precision code {precision_code}")
        payload = len(data) - HEADER_BYTES
        if kind == Kind.NACK and flags & Flag.RESCALE and (count or payload):
            raise WireError(f"RESCALE NACK with {count} lanes and {payload} unexpected payload bytes: it names "
                            f"one chunk in its header")
        if kind in LANED_KINDS:
            # lanes may be padded (with zeros) up to the layout's lane width; count says how many matter
            width = precision.lane_bytes
            if payload % width or not width * count <= payload <= width * MAX_LANES:
                raise WireError(f"{kind.name} datagram with {payload} payload bytes cannot hold {count} lanes")
        elif kind in MAX_PAYLOAD:
            if payload > MAX_PAYLOAD[kind]:
                raise WireError(f"{kind.name} datagram with {payload} payload bytes (at most {MAX_PAYLOAD[kind]})")
        elif payload:
            raise WireError(f"{kind.name} datagram carries {payload} unexpected payload bytes")
        flag = _FLAGS.get(flags)
        if flag is None:
            raise WireError(f"unknown flags 0x{flags:02x}")
        if total and kind != Kind.RESULT:
            raise WireError(f"{kind.name} datagram with total {total}: only RESULT carries one")
        return cls(kind=kind, job=job, worker=worker, iteration=iteration, tensor=tensor, chunk=chunk, slot=slot,
                   count=count, scale=scale, need=need, flags=flag, total=total, token=token, precision=precision,
                   wscale=wscale, epoch=epoch)


def lanes_of(data: bytes | bytearray | memoryview, dtype: str = "<i4") -> np.ndarray:
    """The payload lanes of a datagram as a read-only view (int32 for DATA/AGG, float32 for RESULT)."""
    return np.frombuffer(data, dtype, offset=HEADER_BYTES)


def c_definitions() -> str:
    """The header for C: ``struct ns_hdr`` (packed, fields as in ``FIELDS``), the NS_* constants and
    static asserts that every field sits at the offset this module uses. The loader puts this text in
    front of bpf/aggregator.c, so the program parses exactly the layout defined here."""
    declarations = [f"__{f.ctype} {f.name};" for f in FIELDS]
    width = max(map(len, declarations)) + 1
    lines = ["/* Generated from netstorm/lan/header.py (FIELDS): the LAN edge datagram header. */",
             "#include <linux/types.h>",
             f"#define NS_MAGIC 0x{MAGIC:04X}",
             f"#define NS_VERSION {VERSION}",
             f"#define NS_HEADER_BYTES {HEADER_BYTES}",
             f"#define NS_MAX_LANES {MAX_LANES}",
             f"#define NS_MAX_WORKERS {MAX_WORKERS}",
             f"#define NS_NEED_NONE {NEED_NONE}"]
    lines += [f"#define NS_KIND_{k.name} {int(k)}" for k in Kind]
    lines += [f"#define NS_KIND_{name} {number}" for name, number in LOADER_KINDS.items()]
    lines += [f"#define NS_FLAG_{f.name} {int(f)}" for f in Flag if f.name and f is not Flag.NONE]
    lines += [f"#define NS_PREC_{p.name} {int(p)}" for p in Precision]
    lines.append("struct ns_hdr {")
    lines += [f"    {d.ljust(width)}/* {f.meaning} */" for d, f in zip(declarations, FIELDS, strict=True)]
    lines.append("} __attribute__((packed));")
    lines.append(f'_Static_assert(sizeof(struct ns_hdr) == {HEADER_BYTES}, "ns_hdr size");')
    lines += [f'_Static_assert(__builtin_offsetof(struct ns_hdr, {name}) == {offset}, "ns_hdr.{name}");'
              for name, offset in OFFSETS.items()]
    return "\n".join(lines) + "\n"
