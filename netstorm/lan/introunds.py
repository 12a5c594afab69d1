"""FediAC's rounds on the LAN tier: which lanes travel in each round, as exact integer lanes.

See docs/ARCHITECTURE.md, *The LAN tier*."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence

import numpy as np

from netstorm.compression import voting
from netstorm.compression.options import SCALE, VALUES, VOTES, CompressionOptions
from netstorm.lan.errors import WireError
from netstorm.lan.header import Precision
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.resultwire import Format, ResultWire
from netstorm.layout import Layout, TensorSpec

EXACT_LANE = 2**24
"""Largest integer a LAN worker's lanes carry exactly: the worker hands its lanes over as float32. Rounds'
integers stay far below it (a vote is 0 or 1, a b-bit value at most 2**23 with b <= 24)."""


class Kind(enum.Enum):
    DENSE = "dense"
    VOTES = "votes"
    VALUES = "values"
    REUSED = "reused"
    """Values at a kept GIA with the scale one-hot, no vote (``fediac_gia_reuse``, ours)."""


@dataclasses.dataclass(frozen=True)
class Wire:
    """One round's wire: which registered tensors travel, how many leading lanes of each, at which scale."""

    kind: Kind
    tensors: tuple[int, ...]
    """Index, in the node's layout order (``layout_order``), of each tensor on the wire, ascending."""
    extents: tuple[int, ...]
    """Leading elements of each that travel (the rest are zeros at every contributor)."""
    layout: EdgeLayout
    integer: bool
    """Whether every lane is an exact integer at scale 0 (overflow is then an error, not a rescale)."""
    gia: int = 0
    """The values round's GIA size (0 otherwise)."""
    precision: Precision = Precision.FIXED32
    """How the lanes travel: INT8 where every contributor's integer fits -127..127 (a vote, the scale
    one-hot, values of b <= 8 bits), a quarter of the bytes; the aggregator widens them to int32 exactly
    (an integer x travels as x * 2**w and is shifted back), so the sums are the same. It is the narrowest
    lane of the round: a contributor whose own integers outgrew it sends its push wider (fp16, else int32
    lanes; ``precision.integer_precision``), and the slot adds the mix exactly."""
    back: ResultWire | None = None
    """How the result goes back to the LAN (None: float32 lanes on ``layout``)."""
    served: int = 0
    """Iterations the GIA of this values round has served, this one's included (0: not a values round)."""

    @property
    def result(self) -> ResultWire:
        return ResultWire.float32(self.layout) if self.back is None else self.back


class RoundPlan:
    """The wires of a compressed job's rounds, identical at every LAN worker and at the gateway."""

    def __init__(self, registered: Mapping[str, np.ndarray], options: CompressionOptions, *, lanes: int, pool: int,
                 scale: int, contributors: int, applied: int = 0) -> None:
        """``registered``: every tensor ``Rounds.registered`` gives (in any order: the wire follows the
        node's layout order); ``lanes``, ``pool`` and ``scale``: the LAN deployment's; ``contributors``
        and ``applied``: as ``Rounds.start`` takes them (N, and the threshold the WAN roots already
        applied, 0: none)."""
        if not options.sparse:
            raise ValueError(f"compression {options.method!r} has no integer rounds")
        self.options = options
        self.names = layout_order(registered)
        self.sizes = tuple(max(1, int(np.asarray(registered[n]).size)) for n in self.names)
        self.integer = tuple(np.asarray(registered[n]).dtype.kind in "iu" for n in self.names)
        self.lanes = lanes
        self.pool = pool
        self.scale = scale
        self.threshold = 1 if applied else options.votes_of(contributors)
        """What the gateway applies to the counts it returns (1: the roots' GIA, 0/1 already)."""
        self._index = {name: i for i, name in enumerate(self.names)}
        self.model = tuple(i for i, n in enumerate(self.names) if n not in (VOTES, SCALE, VALUES))
        self._first = Kind.DENSE if options.spec.quantized and not options.bits else Kind.VOTES

    # ---- the schedule -------------------------------------------------------------------------------

    def first(self) -> Wire:
        """The first summed iteration's wire (after ``init``)."""
        return self.wire(self._first)

    def following(self, wire: Wire, returned: Sequence[np.ndarray]) -> Wire:
        """The next iteration's wire, from what this one's result returned to the LAN (``returned``: one
        array per wire tensor, as ``returned`` makes them: a votes round's GIA as 0/1)."""
        if wire.kind is Kind.VOTES:
            gia = np.asarray(returned[wire.tensors.index(self._index[VOTES])])
            return self.wire(Kind.VALUES, gia_size(gia, 1), served=1)
        # the codec's rule (``FediacCodec.must_vote``): a GIA serves ``gia_reuse`` iterations; top-k votes always
        reuse = self.options.gia_reuse if self.options.spec.quantized else 1
        if wire.kind in (Kind.VALUES, Kind.REUSED) and wire.served < reuse:
            return self.wire(Kind.REUSED, wire.gia, served=wire.served + 1)
        return self.wire(Kind.VOTES)

    def restart(self, failed: Wire) -> Wire:
        """The wire after a failed iteration: every contributor starts the whole iteration again
        (``Rounds.abort``), so votes, or the dense round again if that was the one that failed (b is not
        derived yet), or the same reused values wire if that was it (the undone codec still keeps the GIA
        and the count of iterations it served, so it reuses it again)."""
        if failed.kind is Kind.REUSED:
            return self.wire(Kind.REUSED, failed.gia, served=failed.served)
        return self.wire(Kind.DENSE if failed.kind is Kind.DENSE else Kind.VOTES)

    def returned(self, wire: Wire, result: Sequence[np.ndarray]) -> list[np.ndarray]:
        """What of a wire's result (the DC's, one array per wire tensor) goes back to the LAN: a votes
        round's counts as the 0/1 GIA (the threshold applied here, where the full count is known; counts the
        roots thresholded are 0/1 already), the scale histogram as its occupied buckets, the rest as is."""
        out = []
        for t, part in zip(wire.tensors, result, strict=True):
            flat = np.asarray(part).reshape(-1)
            if self.names[t] == VOTES:
                flat = (flat >= self.threshold).astype(np.float32)
            elif self.names[t] == SCALE:
                flat = (flat != 0).astype(np.float32)
            out.append(flat)
        return out

    def wire(self, kind: Kind, gia: int = 0, *, served: int = 0) -> Wire:
        if kind is Kind.DENSE:
            tensors = self.model
            extents = tuple(self.sizes[t] for t in tensors)
        elif kind is Kind.VOTES:
            tensors = tuple(sorted(self._index[n] for n in (VOTES, SCALE) if n in self._index))
            extents = tuple(self.sizes[t] for t in tensors)
        else:
            values = self._index[VALUES]
            if not 0 <= gia <= self.sizes[values]:
                raise WireError(f"a GIA of {gia} indices in a model of {self.sizes[values]} elements")
            # an empty GIA still sends one lane: a round every contributor takes part in, all zeros
            chosen = {values: max(1, gia)}
            if kind is Kind.REUSED:   # the next reused iteration's m travels with these values
                chosen[self._index[SCALE]] = self.sizes[self._index[SCALE]]
            tensors = tuple(sorted(chosen))
            extents = tuple(chosen[t] for t in tensors)
        integer = all(self.integer[t] for t in tensors)
        scales = tuple(0 if self.integer[t] else self.scale for t in tensors)
        layout = EdgeLayout(extents, scales, lanes=self.lanes, pool=self.pool)
        # |f U| <= (2**(b-1) - N) / N <= 2**(b-1) - 1, so |round(f U)| <= 2**(b-1) - 1: int8 up to b = 8
        narrow = integer and (kind is Kind.VOTES or 0 < self.options.bits <= 8)
        back = None if kind is Kind.DENSE else ResultWire.of(
            extents, [self._format(t) for t in tensors], lanes=self.lanes)
        return Wire(kind, tensors, extents, layout, integer, gia if kind in (Kind.VALUES, Kind.REUSED) else 0,
                    Precision.INT8 if narrow else Precision.FIXED32, back, served)

    def _format(self, tensor: int) -> Format:
        """How a tensor's result goes back: the GIA and the scale's occupied buckets as bitmaps, other
        integers as integers, floats (top-k's values) as float32."""
        if self.names[tensor] in (VOTES, SCALE):
            return Format.BITMAP
        return Format.INTEGER if self.integer[tensor] else Format.FLOAT

    # ---- a contributor's lanes and the full tensors back --------------------------------------------

    def lanes_of(self, wire: Wire, push: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """What travels of ``push`` (every registered tensor, as ``Rounds`` yields them): float32, one array
        per wire tensor. WireError if a lane outside the wire is nonzero (it would be lost) or an integer
        lane is beyond what float32 carries exactly."""
        out = []
        on_wire = dict(zip(wire.tensors, wire.extents, strict=True))
        for t, name in enumerate(self.names):
            flat = np.asarray(push[name]).reshape(-1)
            extent = on_wire.get(t, 0)
            if np.any(flat[extent:]):
                raise WireError(f"{wire.kind.value} round: tensor {name!r} is nonzero past the {extent} lanes "
                                f"that travel")
            if t not in on_wire:
                continue
            part = flat[:extent]
            # beyond a narrow wire's range the sender widens the push; past 2**24 nothing carries it exactly
            if self.integer[t] and part.size and int(np.max(np.abs(part.astype(np.int64)))) > EXACT_LANE:
                raise WireError(f"tensor {name!r}: an integer beyond {EXACT_LANE}, not exact in a LAN lane")
            lane = np.zeros(extent, np.float32)
            lane[:part.size] = part
            out.append(lane)
        return out

    def expand(self, wire: Wire, sums: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Every registered tensor's flat float32 array from a wire's per-tensor arrays (zeros elsewhere)."""
        full = [np.zeros(size, np.float32) for size in self.sizes]
        for t, extent, part in zip(wire.tensors, wire.extents, sums, strict=True):
            full[t][:extent] = np.asarray(part, np.float32).reshape(-1)[:extent]
        return full

    def restrict(self, wire: Wire, full: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The wire's part of every registered tensor's flat array (what a result sends back)."""
        return [np.asarray(full[t], np.float32).reshape(-1)[:extent]
                for t, extent in zip(wire.tensors, wire.extents, strict=True)]

    def shaped(self, full: Sequence[np.ndarray], like: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Flat arrays back as the registered tensors' shapes and dtypes (integer sums exact)."""
        out = {}
        for name, flat in zip(self.names, full, strict=True):
            ref = np.asarray(like[name])
            out[name] = np.asarray(flat)[:ref.size].reshape(ref.shape)
            if ref.dtype.kind in "iu":
                out[name] = np.rint(out[name]).astype(np.int64)
        return out


class GatewayRounds:
    """The gateway's side of a ``RoundPlan``: the wire of each iteration, the LAN sums as whole registered
    tensors for the node, and the part of each result that goes back to the LAN."""

    def __init__(self, plan: RoundPlan, first_iteration: int) -> None:
        self.plan = plan
        self.wires: dict[int, Wire] = {first_iteration: plan.first()}

    @classmethod
    def of_layout(cls, layout: Layout, options: CompressionOptions, *, lanes: int, pool: int, scale: int,
                  contributors: int, first_iteration: int) -> GatewayRounds:
        """The rounds of a job whose trainer registered ``layout`` (its tensors, integer ones included, and
        the threshold the WAN roots applied), from ``first_iteration`` on; ``contributors``: at least one."""
        registered = {t.name: np.zeros(t.size, t.dtype) for t in layout.tensors}
        plan = RoundPlan(registered, options, lanes=lanes, pool=pool, scale=scale, contributors=max(1, contributors),
                         applied=layout.gia_threshold)
        return cls(plan, first_iteration)

    def wire_of(self, iteration: int) -> Wire:
        wire = self.wires.get(iteration)
        if wire is None:
            raise WireError(f"iteration {iteration} has no planned wire: its previous result was not released")
        return wire

    def contribution(self, iteration: int, lan: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The LAN's sum as every registered tensor (float32, flat): the wire's sums, zeros past it."""
        return self.plan.expand(self.wire_of(iteration), lan)

    def released(self, iteration: int, full: Sequence[np.ndarray]) -> tuple[list[np.ndarray], Wire]:
        """Iteration ``iteration``'s result (every registered tensor, flat) is going back to the LAN: what of
        it travels (``RoundPlan.returned``, in the wire's ``result`` form), and the next iteration's wire
        (planned here, before any worker can send)."""
        wire = self.wire_of(iteration)
        back = self.plan.returned(wire, self.plan.restrict(wire, full))
        following = self.plan.following(wire, back)
        self._planned(iteration, following)
        return back, following

    def failed(self, iteration: int) -> Wire | None:
        """Iteration ``iteration`` failed (no result goes back): the next one restarts the rounds
        (``RoundPlan.restart``), as every contributor's ``Rounds`` does after its ``abort``. None when
        ``iteration`` has no wire (not a summed iteration of this job) or the next one is planned already
        (a failure reported twice)."""
        wire = self.wires.get(iteration)
        if wire is None or iteration + 1 in self.wires:
            return None
        following = self.plan.restart(wire)
        self._planned(iteration, following)
        return following

    def _planned(self, iteration: int, following: Wire) -> None:
        self.wires[iteration + 1] = following
        for old in [k for k in self.wires if k < iteration - 4]:
            del self.wires[old]


def layout_order(registered: Mapping[str, np.ndarray]) -> tuple[str, ...]:
    """The registered tensors' names in the order of the node's layout (float tensors first, then integer
    ones by lane, by name within each): the order of the gateway's tensors, hence of a LAN worker's."""
    specs = [TensorSpec.of(name, np.asarray(value)) for name, value in registered.items()]
    return tuple(t.name for t in Layout.build(specs, 1 << 62).tensors)


def gia_size(counts: np.ndarray, threshold: int) -> int:
    """How many indices the GIA holds: the count of summed votes at or above the threshold."""
    return int(voting.consensus(counts, threshold).size)
