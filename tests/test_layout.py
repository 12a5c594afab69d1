"""The chunk layout: every element in exactly one chunk, limits respected, the same on every node."""

from __future__ import annotations

import numpy as np
import pytest

from netstorm.errors import LayoutError
from netstorm.layout import Layout, TensorSpec


def specs(sizes: dict[str, int]) -> list[TensorSpec]:
    return [TensorSpec(name, (size,), "float32") for name, size in sizes.items()]


def covered(layout: Layout) -> np.ndarray:
    hits = np.zeros(layout.total, dtype=np.int64)
    for chunk in layout.chunks:
        hits[chunk.offset:chunk.stop] += 1
    return hits


def test_every_element_in_exactly_one_chunk_and_no_chunk_above_limit():
    rng = np.random.default_rng(3)
    for _ in range(300):
        sizes = {f"t{i}": int(rng.integers(0, 40)) for i in range(int(rng.integers(1, 12)))}
        chunk_size = int(rng.integers(1, 17))
        if sum(sizes.values()) == 0:
            with pytest.raises(LayoutError, match="no elements"):
                Layout.build(specs(sizes), chunk_size)
            continue
        layout = Layout.build(specs(sizes), chunk_size)
        assert layout.total == sum(sizes.values())
        assert (covered(layout) == 1).all()
        assert all(0 < c.count <= chunk_size for c in layout.chunks)
        offsets = [c.offset for c in layout.chunks]
        assert offsets == sorted(offsets)
        # A tensor that fits in one chunk is never cut; larger ones are cut into near-equal pieces.
        for key, spec in enumerate(layout.tensors):
            lo, hi = layout.key_chunks[key]
            if 0 < spec.size <= chunk_size:
                assert hi - lo == 1
            elif spec.size > chunk_size:
                pieces = [layout.chunks[i].count for i in range(lo, hi)]
                assert sum(pieces) == spec.size and max(pieces) - min(pieces) <= 1
                assert len(pieces) == -(-spec.size // chunk_size)
            for index in range(lo, hi):
                assert layout.chunks[index].first_key <= key <= layout.chunks[index].last_key


def test_small_tensors_share_a_chunk_in_name_order():
    layout = Layout.build(specs({"c": 3, "a": 2, "b": 10, "d": 4}), 8)
    assert layout.names() == ["a", "b", "c", "d"]
    # a (2) alone, b (10) split 5+5, c+d (3+4) together.
    assert [(c.offset, c.count) for c in layout.chunks] == [(0, 2), (2, 5), (7, 5), (12, 7)]
    assert layout.key_chunks == ((0, 1), (1, 3), (3, 4), (3, 4))
    assert (layout.chunks[3].first_key, layout.chunks[3].last_key) == (2, 3)


def test_hash_ignores_registration_order_but_not_shapes_dtypes_or_chunk_size():
    base = Layout.build([TensorSpec("w", (3, 4), "float32"), TensorSpec("b", (4,), "float32")], 5)
    same = Layout.build([TensorSpec("b", (4,), "float32"), TensorSpec("w", (3, 4), "float32")], 5)
    assert base.hash == same.hash
    assert Layout.build([TensorSpec("w", (4, 3), "float32"), TensorSpec("b", (4,), "float32")], 5).hash != base.hash
    assert Layout.build([TensorSpec("w", (3, 4), "float16"), TensorSpec("b", (4,), "float32")], 5).hash != base.hash
    assert Layout.build([TensorSpec("w", (3, 4), "float32"), TensorSpec("b", (4,), "float32")], 6).hash != base.hash


def test_bad_tensor_lists_are_rejected_by_name():
    with pytest.raises(LayoutError, match="twice: w"):
        Layout.build([TensorSpec("w", (1,), "float32"), TensorSpec("w", (2,), "float32")], 4)
    with pytest.raises(LayoutError, match="int64"):
        TensorSpec("w", (1,), "int64")
    with pytest.raises(LayoutError, match="no tensors"):
        Layout.build([], 4)
    layout = Layout.build(specs({"a": 1, "b": 2}), 4)
    assert layout.key("b") == 1
    with pytest.raises(LayoutError, match="'zz'"):
        layout.key("zz")


def _reference_chunk_keys(layout: Layout) -> tuple[list[int], list[int], list[str]]:
    """Each chunk's first and last tensor and its lane, tensor by tensor (the plain definition)."""
    first = [len(layout.tensors)] * len(layout.chunks)
    last = [-1] * len(layout.chunks)
    for key, (lo, hi) in enumerate(layout.key_chunks):
        for index in range(lo, hi):
            first[index] = min(first[index], key)
            last[index] = max(last[index], key)
    lanes = []
    for chunk in layout.chunks:
        holder = max(k for k, spec in enumerate(layout.tensors) if spec.size and layout.offsets[k] <= chunk.offset)
        dtype = layout.tensors[holder].dtype
        lanes.append(dtype if dtype in ("uint8", "int8", "int16", "int32") else "float32")
    return first, last, lanes


def test_chunk_keys_and_lanes_match_their_plain_definition_on_mixed_models():
    rng = np.random.default_rng(11)
    dtypes = ["float32", "float16", "uint8", "int16", "int32"]
    for _ in range(200):
        count = int(rng.integers(1, 14))
        model = [TensorSpec(f"t{i}", (int(rng.integers(0, 30)),), dtypes[int(rng.integers(0, len(dtypes)))])
                 for i in range(count)]
        if not any(spec.size for spec in model):
            continue
        layout = Layout.build(model, int(rng.integers(1, 12)))
        first, last, lanes = _reference_chunk_keys(layout)
        assert [c.first_key for c in layout.chunks] == first
        assert [c.last_key for c in layout.chunks] == last
        assert [c.dtype for c in layout.chunks] == lanes
        for key, spec in enumerate(layout.tensors):  # a tensor's chunks cover it (an empty one names one chunk)
            lo, hi = layout.key_chunks[key]
            if spec.size:
                assert layout.chunks[lo].offset <= layout.offsets[key]
                assert layout.chunks[hi - 1].stop >= layout.offsets[key] + spec.size
            else:
                assert hi == lo + 1


def test_hashes_are_those_of_earlier_releases():
    """Nodes of one job compare hashes: a faster build must not change them."""
    model = [TensorSpec("w", (3, 4), "float32"), TensorSpec("b", (4,), "float16"),
             TensorSpec("votes", (5,), "uint8"), TensorSpec("e", (0,), "int32")]
    assert Layout.build(model, 8).hash == "9e3750cdfecbc7c2"
    fediac = [TensorSpec("w", (3, 4), "float32"), TensorSpec("votes", (5,), "uint8")]
    assert Layout.build(fediac, 8, "float16", ("votes", 2)).hash == "ce21e2b394aae6e9"


def test_a_model_of_100k_tensors_builds_and_duplicates_are_found_among_them():
    """Layout building is O(n log n) (its time is measured by ``netstorm bench layout``)."""
    model = [TensorSpec(f"layer{i:06d}", (3,), "float32") for i in range(100_000)]
    layout = Layout.build(model, 65536)
    assert layout.total == 300_000 and len(layout.chunks) == 5
    assert layout.key(f"layer{99_999:06d}") == 99_999
    with pytest.raises(LayoutError, match="registered twice: layer000007, layer004321"):
        Layout.build([*model[:5000], TensorSpec("layer004321", (3,), "float32"),
                      TensorSpec("layer000007", (2,), "int8")], 65536)
