"""The agent's and the workers' per-batch work without temporaries: results converted in place
(``dequantize_rows``, ``chunk_results_into``), rows copied run by run (``copy_rows``), distinct values
without ``np.unique`` (``distinct``) and buffers with their pages mapped up front (``populated``) give
exactly what the plain numpy expressions give, at every scale, gap and repeat."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netstorm.lan.batch import RUN_SEGMENTS, copy_rows, distinct
from netstorm.lan.fixedpoint import EXACT_FLOAT32_SCALES, dequantize, dequantize_rows
from netstorm.lan.header import HEADER_BYTES
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.packets import chunk_result_packets, chunk_results_into, result_packets
from netstorm.lan.prefault import populated
from netstorm.lan.sums import IterationSums

INT32 = np.iinfo(np.int32)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), scales=st.lists(st.integers(-128, 126), min_size=1, max_size=6))
def test_rows_convert_exactly_as_the_float64_product_rounded_once(seed: int, scales: list[int]) -> None:
    rng = np.random.default_rng(seed)
    raw = rng.integers(INT32.min, INT32.max, (len(scales), 40), dtype=np.int64, endpoint=True).astype(np.int32)
    raw[:, :4] = [0, 1, -1, INT32.max]          # the edges: zero, the smallest and largest magnitudes
    with np.errstate(over="ignore"):            # scales below the exact range overflow float32 in both
        want = np.stack([dequantize(row, s) for row, s in zip(raw, scales, strict=True)])
        got = dequantize_rows(raw, np.array(scales))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def test_the_float32_route_is_taken_inside_its_range_and_matches_at_both_ends() -> None:
    low, high = EXACT_FLOAT32_SCALES
    raw = np.array([[INT32.max, INT32.min + 1, 3, -(2**24) - 1, 2**24 + 3, 1]] * 2, np.int32)
    for pair in ((low, high), (low, low), (high, high)):
        np.testing.assert_array_equal(dequantize_rows(raw, np.array(pair)),
                                      np.stack([dequantize(raw[0], pair[0]), dequantize(raw[1], pair[1])]))
    out = np.full((2, raw.shape[1] + 3), 7.0, np.float32)   # a strided view, as in a datagram's rows
    dequantize_rows(raw, np.array([20, 21]), out=out[:, 3:])
    assert (out[:, :3] == 7.0).all()
    np.testing.assert_array_equal(out[:, 3:], np.stack([dequantize(raw[0], 20), dequantize(raw[1], 21)]))


@settings(max_examples=80, deadline=None)
@given(dst=st.lists(st.integers(0, 63), min_size=0, max_size=48), seed=st.integers(0, 2**32 - 1),
       runs=st.booleans())
def test_row_copies_equal_the_gather_and_scatter(dst: list[int], seed: int, runs: bool) -> None:
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 1000, (100, 5))
    if runs:   # mostly consecutive, with a few gaps and repeats: what a batch of aggregates looks like
        start = int(rng.integers(0, 16))
        dst = sorted({start + i for i in range(len(dst))} - {d for d in dst if d % 7 == 0})
    dst_rows = np.array(dst, np.int64)
    src_rows = np.sort(rng.choice(100, dst_rows.size, replace=False)) if dst_rows.size else dst_rows
    if runs and dst_rows.size:
        src_rows = np.arange(dst_rows.size) + int(rng.integers(0, 100 - dst_rows.size + 1))
    want = np.full((64, 5), -1)
    got = want.copy()
    want[dst_rows] = src[src_rows]
    copy_rows(got, dst_rows, src, src_rows)
    np.testing.assert_array_equal(got, want)


def test_a_repeated_row_ends_as_its_later_copy_in_both_routes() -> None:
    src = np.arange(40).reshape(20, 2)
    for extra in (0, RUN_SEGMENTS * 2):         # few stretches: slices; many: the gather and scatter
        dst_rows = np.array([3, 4, 4, 5, *range(10, 10 + 2 * extra, 2)], np.int64)
        src_rows = np.array([0, 1, 2, 3, *range(4, 4 + extra)], np.int64) % 20
        got = np.zeros((128, 2), np.int64)
        copy_rows(got, dst_rows, src, src_rows)
        assert got[4].tolist() == src[2].tolist()


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.integers(-(2**40), 2**40), max_size=50))
def test_distinct_is_np_unique(values: list[int]) -> None:
    array = np.array(values, np.int64)
    np.testing.assert_array_equal(distinct(array), np.unique(array))


def test_populated_buffers_have_the_shape_and_type_asked_and_hold_what_is_written() -> None:
    for shape, dtype in (((3,), np.float32), ((600, 1000), np.int32), ((513, 4096 + 44), np.uint8)):
        buf = populated(shape, dtype)
        assert buf.shape == shape and buf.dtype == dtype and buf.flags.c_contiguous
        buf[...] = 5
        assert (buf == 5).all()


@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("sizes", [[1000, 7], [64 * 5], [1, 130, 64]])
def test_results_built_in_place_run_by_run_are_the_whole_tensor_datagrams(sizes: list[int], gaps: bool) -> None:
    layout = EdgeLayout.uniform(sizes, scale=12, lanes=64)
    rng = np.random.default_rng(3)
    raw = rng.integers(-(2**30), 2**30, (layout.num_chunks, layout.lanes)).astype(np.int32)
    scales = rng.integers(8, 16, layout.num_chunks)
    sums = IterationSums(layout, 9, 4, 2)
    sums.raw[:] = raw
    sums.scales[:] = scales
    sums.open[:] = False
    sums.remaining = 0
    rows = np.zeros((layout.num_chunks, HEADER_BYTES + 4 * layout.lanes), np.uint8)
    rows[:, HEADER_BYTES:] = 0xAB       # what a row held before: every byte of a chunk's row is written
    order = rng.permutation(layout.num_chunks)
    # completed in batches with gaps, as under loss: each batch's sorted chunks, in runs; with ``gaps``, a
    # batch of all but a few chunks (converted as one span, the gaps' rows written again later) and then those
    late = order[:2] if gaps else order[:0]
    parts = [np.setdiff1d(order, late), late] if gaps else np.array_split(order, 3)
    for part in parts:
        seqs = np.sort(part)
        views = chunk_results_into(rows, layout, job=2, iteration=9, seqs=seqs, raw=raw, scales=scales, total=4)
        assert sum(len(v) for v in views) == seqs.size
        assert all(np.shares_memory(v, rows) for v in views)
        np.testing.assert_array_equal(np.concatenate(views),
                                      chunk_result_packets(layout, job=2, iteration=9, seqs=seqs, raw=raw,
                                                           scales=scales, total=4))
    whole = [result_packets(layout, job=2, iteration=9, tensor=t, values=v, total=4)
             for t, v in enumerate(sums.result())]
    for t, block in enumerate(whole):
        first = layout.first_slot[t]
        np.testing.assert_array_equal(rows[first: first + layout.chunks[t]], block)
        for chunk in range(layout.chunks[t]):
            start, stop = layout.bounds(t, chunk)
            np.testing.assert_array_equal(sums.part(t, start, stop), sums.result()[t][start:stop])
