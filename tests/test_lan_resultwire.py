"""Narrow RESULT lanes (netstorm/lan/resultwire.py): a compressed round's integer sums travel at the narrowest
width that holds them, a GIA as a bitmap; what a worker gathers from the datagrams, in any order and mixed
with hostile ones, is exactly what the gateway encoded; nothing a format cannot carry exactly is sent."""

from __future__ import annotations

import numpy as np
import pytest

from netstorm.lan.batch import valid_headers
from netstorm.lan.errors import WireError
from netstorm.lan.header import HEADER_BYTES, OFFSETS, Header, Kind, Precision
from netstorm.lan.packets import result_packets
from netstorm.lan.resultgather import ResultGather
from netstorm.lan.resultwire import Format, ResultWire
from tests.test_edge_batch import batch_of

JOB = 7
LANES = 64


@pytest.mark.parametrize(("low", "high", "precision"), [(-128, 127, Precision.INT8), (0, 128, Precision.INT16),
                                                        (-32768, 5, Precision.INT16), (-1, 32768, Precision.INT32),
                                                        (-2**24, 2**24, Precision.INT32)])
def test_integers_travel_at_the_narrowest_width_that_holds_them(low: int, high: int, precision: Precision) -> None:
    back = ResultWire.of([300], [Format.INTEGER], lanes=LANES)
    values = np.linspace(low, high, 300).round().astype(np.float32)
    values[[0, -1]] = [low, high]
    got, lanes = back.encode(0, values)
    assert got is precision and np.array_equal(lanes.astype(np.int64), values.astype(np.int64))


def test_a_result_wire_refuses_what_its_format_cannot_carry_exactly() -> None:
    back = ResultWire.of([10, 20], [Format.INTEGER, Format.BITMAP], lanes=LANES)
    with pytest.raises(WireError, match="fraction"):
        back.encode(0, np.full(10, 0.5, np.float32))
    with pytest.raises(WireError, match="fraction or an integer beyond"):
        back.encode(0, np.full(10, 2.0**24 + 2, np.float64))
    with pytest.raises(WireError, match="other than 0 and 1"):
        back.encode(1, np.full(20, 2, np.float32))
    with pytest.raises(WireError, match="elements"):
        back.encode(1, np.zeros(21, np.float32))


def _set(data: bytes, field: str, value: int) -> bytes:
    return data[:OFFSETS[field]] + bytes([value]) + data[OFFSETS[field] + 1:]


def test_a_worker_gathers_exactly_what_the_gateway_encoded_in_fewer_bytes() -> None:
    rng = np.random.default_rng(4)
    gia = (rng.random(5000) < 0.1).astype(np.float32)
    sums = rng.integers(-300, 300, 700).astype(np.float32)
    scale = np.zeros(768, np.float32)
    scale[[40, 90]] = 1
    # a votes round's result: bitmaps only, packed 4 x 64 byte lanes a datagram (the int32 lanes' bytes)
    votes = ResultWire.of([5000, 768], [Format.BITMAP, Format.BITMAP], lanes=LANES)
    assert votes.layout.lanes == 4 * LANES and votes.layout.sizes == (625, 96)
    values = ResultWire.of([700, 768], [Format.INTEGER, Format.BITMAP], lanes=LANES)
    for back, result in ((votes, [gia, scale]), (values, [sums, scale])):
        blocks = []
        for t, r in enumerate(result):
            precision, lanes = back.encode(t, r)
            blocks.append(result_packets(back.layout, job=JOB, iteration=3, tensor=t, values=lanes, total=5,
                                         precision=precision))
        items = [row.tobytes() for block in blocks for row in block]
        assert all(Header.decode(d).precision in (Precision.INT16, Precision.BITMAP) for d in items)
        float32 = sum(HEADER_BYTES + 4 * min(LANES, r.size - c * LANES) for r in result
                      for c in range(-(-r.size // LANES)))
        assert sum(len(d) for d in items) < float32 / 3   # what float32 lanes of every element would take
        # hostile: datagrams relabelled with a precision their tensor does not travel at (valid headers)
        first = Precision.INT8 if back.formats[0] is Format.BITMAP else Precision.BITMAP
        hostile = [_set(items[0], "precision", int(first)), _set(items[-1], "precision", int(Precision.INT8))]
        assert valid_headers(batch_of(hostile).headers(), batch_of(hostile).lengths).all()
        gather = ResultGather(back)
        order = rng.permutation(len(items) + len(hostile))
        everything = items + hostile
        for start in range(0, order.size, 5):
            batch = batch_of([everything[i] for i in order[start: start + 5]])
            gather.take(batch, np.arange(batch.count), worker=1)
        assert gather.complete() and gather.total == 5
        got = gather.result()
        for want, have in zip(result, got, strict=True):
            np.testing.assert_array_equal(have, want)
        assert Header.decode(items[0]).kind is Kind.RESULT


def test_result_precisions_are_accepted_on_results_only() -> None:
    """The decoder and the batch parse agree: INT16, INT32 and BITMAP on RESULT, never on DATA or AGG;
    INT8 on both RESULT and DATA (a DATA's own int8 lanes)."""
    back = ResultWire.of([100], [Format.INTEGER], lanes=LANES)
    genuine = result_packets(back.layout, job=JOB, iteration=1, tensor=0, values=np.zeros(100), total=2,
                             precision=Precision.INT16)[0].tobytes()
    for kind in (Kind.RESULT, Kind.DATA, Kind.AGG):
        for precision in Precision:
            data = _set(_set(genuine, "kind", int(kind)), "precision", int(precision))
            if kind is not Kind.RESULT:   # only a RESULT carries a total
                data = data[:OFFSETS["total"]] + bytes(4) + data[OFFSETS["total"] + 4:]
            allowed = (precision is Precision.FIXED32 and kind is not Kind.DATA) or \
                (kind is Kind.RESULT and precision is not Precision.FP16 and precision is not Precision.BF16) or \
                (kind is Kind.DATA and precision in (Precision.FP16, Precision.BF16, Precision.INT8,
                                                     Precision.FIXED32))
            # the payload is 2 * 64 bytes: it holds 64 lanes at any width but 4 bytes (int32 and float32)
            fits = precision.lane_bytes <= 2
            try:
                Header.decode(data)
                decoded = True
            except WireError:
                decoded = False
            batch = batch_of([data])
            assert decoded == bool(valid_headers(batch.headers(), batch.lengths)[0]) == (allowed and fits), \
                (kind, precision)
