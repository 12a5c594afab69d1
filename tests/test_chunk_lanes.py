"""Integer lanes, elided zero tails and the float16 wire in the aggregation core, checked exactly."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from netstorm.compression import voting
from netstorm.config import Config
from netstorm.errors import ChunkError, FrameError, LayoutError
from netstorm.frames import WIRE_DTYPES, WIRE_FORMATS, ChunkHeader, Phase, decode_header, decode_prefix
from netstorm.layout import INT_EXACT, Layout, TensorSpec
from netstorm.planning.plan import plan
from node.chunks import IterationDone, IterationFailed
from node.core import NodeCore
from tests.test_chunks import RING5, Network, make, rates

NODES = [1, 2, 3, 4, 5]
MIXED = [TensorSpec("w", (40,), "float32"), TensorSpec("votes", (50,), "uint8"),
         TensorSpec("values", (33,), "int16"), TensorSpec("b", (3,), "float16"), TensorSpec("small", (4,), "int8")]


def run_iteration(layout: Layout, values: dict[int, dict[str, np.ndarray]], *, topology: str = "fapt",
                  roots: int = 0, seed: int = 1) -> Network:
    policy = plan(rates(RING5), topology=topology, version=1, num_roots=roots)
    cores = make(NODES, layout)
    net = Network(cores, seed=seed)
    for n in NODES:
        net.take(n, cores[n].bind_policy(0, policy))
    for n in NODES:
        for key, spec in enumerate(layout.tensors):
            net.take(n, cores[n].push_local(0, key, values[n][spec.name]))
    net.run()
    return net


def tensor(net: Network, layout: Layout, node: int, name: str) -> np.ndarray:
    return net.cores[node].result(0)[layout.key_slice(layout.key(name))]


def test_layout_puts_integer_lanes_after_floats_and_never_mixes_them() -> None:
    layout = Layout.build(MIXED, 16)
    assert [t.name for t in layout.tensors] == ["b", "w", "values", "small", "votes"]  # by lane, then name
    assert layout.int_start == 43
    for chunk in layout.chunks:
        lanes = {layout.tensors[k].dtype if layout.is_int(k) else "float32"
                 for k in range(chunk.first_key, chunk.last_key + 1)}
        assert lanes == {chunk.dtype}
    assert [layout.key(t.name) for t in layout.tensors] == list(range(5))
    assert Layout.build(MIXED, 16, "float16").hash != layout.hash
    assert Layout.build(MIXED[::-1], 16).hash == layout.hash
    floats = [TensorSpec("w", (40,), "float32")]
    assert Layout.build(floats, 16).hash == Layout.build(floats, 16, "float32").hash


@pytest.mark.parametrize("topology", ["fapt", "star", "mst"])
def test_integer_sums_are_exact_and_travel_in_their_lane(topology: str) -> None:
    layout = Layout.build(MIXED, 16)
    rng = np.random.default_rng(3)
    values = {n: {"w": rng.integers(-99, 99, 40).astype(np.float32),
                  "votes": rng.integers(0, 2, 50).astype(np.float32),
                  "values": rng.integers(-300, 300, 33).astype(np.float32),
                  "b": rng.integers(-9, 9, 3).astype(np.float32),
                  "small": rng.integers(-20, 20, 4).astype(np.float32)} for n in NODES}
    net = run_iteration(layout, values, topology=topology)
    for n in NODES:
        assert net.events[n][-1] == IterationDone(0)
        for spec in layout.tensors:
            want = np.sum([values[m][spec.name] for m in NODES], axis=0, dtype=np.int64)
            assert np.array_equal(tensor(net, layout, n, spec.name), want.astype(np.float32))
    for send in net.hops:
        chunk = layout.chunks[send.header.chunk]
        assert send.payload.dtype == np.dtype(WIRE_FORMATS[send.header.dtype])
        if chunk.dtype == "float32":
            assert send.header.dtype == "float32"
        elif send.header.dtype == "bit":  # 0/1 sums travel as packed bits
            assert send.payload.size == (send.header.count + 7) // 8
        else:  # the narrowest dtype that holds the partial sum
            low, high = int(send.payload.min(initial=0)), int(send.payload.max(initial=0))
            narrowest = next(d for d in ("uint8" if low >= 0 else "int8", "int16", "int32")
                             if np.iinfo(d).min <= low and high <= np.iinfo(d).max)
            assert send.header.dtype == narrowest and not (low >= 0 and high <= 1 and send.header.count)


def test_vote_counts_and_thresholds_exact_across_multi_root_trees() -> None:
    """Votes sampled as FediAC does, summed over multi-root trees: the counts equal numpy's, and the GIA
    every node derives from them is the same, at every level of every tree."""
    d = 700
    layout = Layout.build([TensorSpec("votes", (d,), "uint8")], 64)
    rng = np.random.default_rng(8)
    updates = {n: rng.standard_normal(d) * rng.pareto(1.2, d) for n in NODES}
    votes = {n: {"votes": voting.sample_votes(updates[n], 120, np.random.default_rng(n)).astype(np.float32)}
             for n in NODES}
    net = run_iteration(layout, votes, roots=3, seed=4)
    assert len({s.header.root for s in net.hops}) == 3
    counts = np.sum([votes[n]["votes"] for n in NODES], axis=0, dtype=np.int64)
    for a in (1, 2, 3):
        want = np.flatnonzero(counts >= a)
        for n in NODES:
            got = tensor(net, layout, n, "votes")
            assert np.array_equal(got, counts.astype(np.float32))
            assert np.array_equal(voting.consensus(got, a), want)
    # a leaf's votes are 0/1: they travel as bits, eight to a byte; partial counts as uint8
    leaf_hops = [s for s in net.hops if s.header.phase is Phase.UP and s.header.dtype == "bit"]
    assert leaf_hops and all(s.payload.size == (s.header.count + 7) // 8 for s in leaf_hops)
    assert {s.header.dtype for s in net.hops} <= {"bit", "uint8"}


def test_a_sum_that_outgrows_a_narrow_lane_widens_the_hop() -> None:
    layout = Layout.build([TensorSpec("c", (10,), "uint8"), TensorSpec("q", (6,), "int8")], 100)
    values = {n: {"c": np.full(10, 200, np.float32), "q": np.array([-128, 127, 5, 0, 0, 0], np.float32)}
              for n in NODES}
    net = run_iteration(layout, values, topology="star")
    for n in NODES:
        assert np.array_equal(tensor(net, layout, n, "c"), np.full(10, 1000, np.float32))
        assert np.array_equal(tensor(net, layout, n, "q"), np.array([-640, 635, 25, 0, 0, 0], np.float32))
    widened = {s.header.dtype for s in net.hops if layout.chunks[s.header.chunk].dtype == "uint8"}
    assert "int16" in widened  # star: the hub's sum of 1000 cannot travel in uint8
    assert all(s.header.count == 3 for s in net.hops if layout.chunks[s.header.chunk].dtype == "int8")


def test_sums_beyond_the_exact_range_fail_the_iteration() -> None:
    layout = Layout.build([TensorSpec("q", (4,), "int32")], 100)
    big = np.array([INT_EXACT, 1, 0, 0], np.float32)
    net = run_iteration(layout, {n: {"q": big} for n in NODES}, topology="star")
    failed = [a for n in NODES for a in net.events[n] if isinstance(a, IterationFailed)]
    assert failed and "2**24" in failed[0].reason
    core = make([1], layout)[1]
    with pytest.raises(ChunkError, match="integers"):
        core.push_local(0, 0, np.array([0.5, 0, 0, 0], np.float32))
    with pytest.raises(ChunkError, match="2\\*\\*24"):
        core.push_local(0, 0, np.array([INT_EXACT * 2, 0, 0, 0], np.float32))


def test_zero_tails_are_elided() -> None:
    layout = Layout.build([TensorSpec("values", (100,), "int16"), TensorSpec("w", (30,), "float32")], 25)
    values = {n: {"values": np.zeros(100, np.float32), "w": np.zeros(30, np.float32)} for n in NODES}
    for n in NODES:
        values[n]["values"][:12 + n] = n  # compacted GIA values of varying length
    values[3]["w"][[0, 4]] = 1.5
    net = run_iteration(layout, values)
    want = np.sum([values[n]["values"] for n in NODES], axis=0)
    for n in NODES:
        assert np.array_equal(tensor(net, layout, n, "values"), want)
        assert np.array_equal(tensor(net, layout, n, "w"), values[3]["w"])
    for send in net.hops:
        chunk = layout.chunks[send.header.chunk]
        assert send.header.count <= chunk.count and send.payload.size == send.header.payload_items
        if send.header.phase is Phase.DOWN:
            if chunk.dtype == "float32":
                assert send.header.count == (5 if chunk.offset == 0 else 0)
            else:
                assert send.header.count == max(0, min(chunk.count, 17 - (chunk.offset - layout.int_start)))


def test_float16_wire_gives_every_dc_the_same_rounded_sum() -> None:
    layout = Layout.build([TensorSpec("w", (64,), "float32"), TensorSpec("h", (5,), "float16")], 20, "float16")
    rng = np.random.default_rng(6)
    values = {n: {"w": rng.standard_normal(64).astype(np.float32), "h": rng.standard_normal(5).astype(np.float32)}
              for n in NODES}
    values[2]["w"][7] = 1e6  # beyond float16: its chunk travels as float32 instead of as inf
    net = run_iteration(layout, values, roots=2)
    exact = {name: np.sum([values[n][name] for n in NODES], axis=0) for name in ("w", "h")}
    for name in ("w", "h"):
        first = tensor(net, layout, 1, name)
        assert np.all(np.isfinite(first))
        np.testing.assert_allclose(first, exact[name], rtol=5e-3, atol=1e-2)
        for n in NODES:
            assert np.array_equal(tensor(net, layout, n, name), first)
    dtypes = {(s.header.chunk, s.header.dtype) for s in net.hops}
    assert any(d == "float16" for _, d in dtypes)
    big = layout.offsets[layout.key("w")] + 7
    assert (next(c.index for c in layout.chunks if c.offset <= big < c.stop), "float32") in dtypes


def _hop(layout: Layout, chunk: int, count: int, dtype: str) -> ChunkHeader:
    return ChunkHeader(iteration=0, chunk=chunk, root=1, phase=Phase.UP, src=2, dst=1, origin=2, final=1,
                       version=1, t_send=0.0, is_aux=False, path=(2, 1), count=count, dtype=dtype)  # type: ignore[arg-type]


def test_hostile_dtypes_and_counts_are_rejected_before_allocation() -> None:
    layout = Layout.build(MIXED, 16)
    core = make([1], layout)[1]
    int_chunk = next(c for c in layout.chunks if c.dtype == "uint8")
    float_chunk = layout.chunks[0]
    core.check_header(_hop(layout, int_chunk.index, int_chunk.count, "int16"))  # a widened lane is fine
    core.check_header(_hop(layout, float_chunk.index, 3, "float16"))
    with pytest.raises(ChunkError, match="float16 payload for a uint8 chunk"):
        core.check_header(_hop(layout, int_chunk.index, 4, "float16"))
    with pytest.raises(ChunkError, match="int8 payload for a float32 chunk"):
        core.check_header(_hop(layout, float_chunk.index, 2, "int8"))
    with pytest.raises(ChunkError, match="elements, layout says"):
        core.check_header(_hop(layout, int_chunk.index, int_chunk.count + 1, "uint8"))
    policy = plan(rates(RING5), topology="star", version=1)
    core.bind_policy(0, policy)
    with pytest.raises(ChunkError, match="payload of 4 uint8, header says 4 int16"):
        core.receive(_hop(layout, int_chunk.index, 4, "int16"), np.zeros(4, np.uint8))
    with pytest.raises(ChunkError, match="beyond 2\\*\\*24"):
        core.receive(_hop(layout, int_chunk.index, 2, "int32"), np.array([0, 1 << 30], "<i4"))


@pytest.mark.parametrize("dtype", sorted(WIRE_DTYPES))
def test_new_wire_dtypes_round_trip(dtype: str) -> None:
    layout = Layout.build(MIXED, 16)
    count = 19
    header = _hop(layout, 2, count, dtype)
    values = np.arange(count) % 2 if dtype == "bit" else np.arange(count)
    payload = np.packbits(values != 0) if dtype == "bit" else values.astype(WIRE_FORMATS[dtype])
    frame = header.encode() + payload.tobytes()
    prefix = decode_prefix(frame, max_frame_bytes=1 << 20)
    items = 3 if dtype == "bit" else count  # 19 bits in 3 bytes
    assert prefix.payload_len == items * WIRE_DTYPES[dtype] == payload.nbytes
    start = len(frame) - prefix.payload_len - prefix.header_len
    decoded = decode_header(prefix, frame[start:start + prefix.header_len])
    assert decoded == header
    back = np.frombuffer(frame[len(frame) - prefix.payload_len:], dtype=WIRE_FORMATS[dtype])
    assert np.array_equal(back, payload)
    if dtype == "bit":
        assert np.array_equal(np.unpackbits(back, count=count), values)


def test_hostile_frames_with_bad_dtype_or_length_are_rejected() -> None:
    layout = Layout.build(MIXED, 16)
    header = _hop(layout, 2, 7, "int16")
    body = msgspec.msgpack.encode({**msgspec.to_builtins(header), "dtype": "complex64"})
    with pytest.raises(FrameError, match="dtype"):
        ChunkHeader.decode(body)
    frame = header.encode()
    prefix = decode_prefix(frame, max_frame_bytes=1 << 20)
    lying = prefix._replace(payload_len=7 * 4)  # 7 int16 are 14 bytes, not 28
    with pytest.raises(FrameError, match="needs 14 payload bytes"):
        decode_header(lying, frame[-prefix.header_len:])


def test_the_node_core_admits_by_the_same_checks() -> None:
    """``NodeCore.admit`` (what the shell asks before allocating a payload) refuses a wrong dtype too."""
    layout = Layout.build(MIXED, 16)
    core = NodeCore(1, Config())
    core.join(Config(), NODES, {})
    core.register(layout, {}, 0.0)
    int_chunk = next(c for c in layout.chunks if c.dtype == "uint8")
    assert core.admit(_hop(layout, int_chunk.index, 3, "int16")) is True
    with pytest.raises(ChunkError, match="float32 payload for a uint8 chunk"):
        core.admit(_hop(layout, int_chunk.index, 3, "float32"))


def test_roots_threshold_the_full_counts_and_send_the_gia_down_as_bits() -> None:
    """FediAC's threshold where the full count is known: each chunk's root, for its shard of the index
    space; every DC gets the same 0/1 GIA, and it travels down the trees as a bitmap."""
    d, a = 700, 2
    specs = [TensorSpec("votes", (d,), "uint8"), TensorSpec("scale", (20,), "uint8")]
    layout = Layout.build(specs, 64, gia=("votes", a))
    assert layout.gia_threshold == a and layout.tensors[layout.gia_key].name == "votes"
    assert layout.hash != Layout.build(specs, 64).hash != Layout.build(specs, 64, gia=("votes", 3)).hash
    rng = np.random.default_rng(12)
    votes = {n: {"votes": (rng.random(d) < 0.3).astype(np.float32), "scale": rng.integers(0, 2, 20).astype(np.float32)}
             for n in NODES}
    net = run_iteration(layout, votes, roots=3, seed=2)
    counts = np.sum([votes[n]["votes"] for n in NODES], axis=0)
    for n in NODES:
        assert np.array_equal(tensor(net, layout, n, "votes"), (counts >= a).astype(np.float32))
        assert np.array_equal(tensor(net, layout, n, "scale"), np.sum([votes[m]["scale"] for m in NODES], axis=0))
    gia_chunks = {c.index for c in layout.chunks if c.first_key <= layout.gia_key <= c.last_key
                  and c.last_key == c.first_key}
    down = [s for s in net.hops if s.header.phase is Phase.DOWN and s.header.chunk in gia_chunks and s.header.count]
    assert down and all(s.header.dtype == "bit" for s in down)
    with pytest.raises(LayoutError, match="integer tensor"):
        Layout.build([TensorSpec("votes", (d,), "float32")], 64, gia=("votes", a))
