"""The torch backend's encodings: what a node's float32 sum gives back must be exact where they say so."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import IN_CI

if not IN_CI:  # the torch marker's rule, at collection: skip without torch, fail in CI
    pytest.importorskip("torch")
import torch

from netstorm.torch import codec

pytestmark = pytest.mark.torch

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]


def sample(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=gen) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(n, generator=gen, dtype=torch.float64) * 1e3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=gen, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 64])
def test_a_copy_summed_with_zeros_comes_back_bit_for_bit(dtype: torch.dtype, n: int) -> None:
    source = sample(dtype, n, seed=n)
    pieces = codec.bits(source)
    assert pieces.dtype == np.float32 and pieces.size == codec.bits_size(source)
    assert pieces.max(initial=0) < codec.PIECE
    summed = pieces + np.zeros_like(pieces) + np.zeros_like(pieces)  # the other ranks contribute zeros
    target = torch.zeros(n, dtype=dtype)
    codec.store_bits(target, summed)
    assert torch.equal(target.view(torch.uint8) if dtype != torch.bool else target,
                       source.view(torch.uint8) if dtype != torch.bool else source)


def test_allgather_slots_are_each_ranks_bits() -> None:
    ranks = [sample(torch.int64, 5, seed=r) for r in range(3)]
    size = codec.bits_size(ranks[0])
    total = np.zeros(3 * size, np.float32)
    for r, tensor in enumerate(ranks):
        part = np.zeros(3 * size, np.float32)
        part[r * size:(r + 1) * size] = codec.bits(tensor)
        total += part
    for r, tensor in enumerate(ranks):
        out = torch.empty(5, dtype=torch.int64)
        codec.store_bits(out, total[r * size:(r + 1) * size])
        assert torch.equal(out, tensor)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool])
def test_integer_sums_are_exact_with_carries_and_wrap_around(dtype: torch.dtype) -> None:
    ranks = [sample(dtype, 33, seed=10 + r) for r in range(5)]
    summed = sum((codec.int_sum_bits(t) for t in ranks), np.zeros(4 * 33, np.float32))
    out = torch.zeros(33, dtype=dtype)
    codec.store_int_sum(out, summed)
    with np.errstate(over="ignore"):
        expected = sum((t.to(torch.int64).numpy() for t in ranks), np.zeros(33, np.int64))
    assert torch.equal(out, torch.from_numpy(expected).to(dtype))


def test_int64_sum_near_the_limits_wraps_like_torch() -> None:
    big = torch.tensor([2**63 - 1, -2**63, -1, 12345678901234], dtype=torch.int64)
    other = torch.tensor([1, -1, -1, -98765432109876], dtype=torch.int64)
    out = torch.zeros(4, dtype=torch.int64)
    codec.store_int_sum(out, codec.int_sum_bits(big) + codec.int_sum_bits(other))
    assert torch.equal(out, big + other)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float_values_widen_exactly_and_narrow_back(dtype: torch.dtype) -> None:
    tensor = sample(dtype, 50, seed=3)
    flat = codec.values(tensor)
    assert flat.dtype == np.float32
    out = torch.empty(50, dtype=dtype)
    codec.store_values(out, flat)
    assert torch.equal(out, tensor)


def test_pieces_that_two_ranks_wrote_are_refused() -> None:
    pieces = codec.bits(torch.tensor([-1], dtype=torch.int16))  # one piece of 65535
    with pytest.raises(ValueError, match="exceeds 16 bits"):
        codec.store_bits(torch.zeros(1, dtype=torch.int16), pieces * 2)
    with pytest.raises(ValueError, match="not whole"):
        codec.store_bits(torch.zeros(1, dtype=torch.int16), pieces + 0.5)
