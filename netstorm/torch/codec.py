"""Tensors as the float32 vectors a node sums, and back.

The node adds float32 values and nothing else. Two encodings cover what ``torch.distributed`` asks:

- *values*: a floating tensor as its float32 values (float16 and bfloat16 widen exactly; float64
  narrows, the one lossy case). Sums and means of gradients travel this way, one element per element.
- *bits*: any tensor's bytes as 16-bit pieces, one float32 per piece. Every piece is an integer below
  2**16, so a float32 sum of such pieces is exact while it stays below 2**24: a copy (broadcast,
  allgather: one rank contributes each piece, the others zeros) comes back bit for bit, integers and
  float64 included, and an integer sum is exact for up to 256 ranks (pieces are re-assembled with
  their carries, wrapping as two's complement as torch's integer sums do). A bits element costs two
  float32 per four bytes of tensor: twice the bytes of the values encoding.
"""

from __future__ import annotations

import numpy as np
import torch

PIECE = 1 << 16
MAX_RANKS_EXACT = (1 << 24) // PIECE
"""Ranks up to which a float32 sum of 16-bit pieces stays exact (an integer sum's limit)."""

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def values(tensor: torch.Tensor) -> np.ndarray:
    """A floating tensor's values as a fresh float32 vector."""
    if tensor.dtype not in FLOATS:
        raise TypeError(f"values encoding is for floating tensors, not {tensor.dtype}")
    return tensor.detach().reshape(-1).to(device="cpu", dtype=torch.float32).numpy().copy()


def store_values(tensor: torch.Tensor, flat: np.ndarray) -> None:
    """Write float32 ``flat`` into ``tensor`` (its dtype and shape), in place."""
    with torch.no_grad():
        tensor.copy_(torch.from_numpy(flat).reshape(tensor.shape))


def _raw(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as uint8 (a copy, contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1).cpu()  # a GPU tensor is staged through host memory
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8).numpy().copy()


def bits(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as float32-held 16-bit pieces (an odd byte count gets one zero byte)."""
    return pieces(_raw(tensor))


def raw_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes (a contiguous uint8 copy, on the host): what ``pieces`` encodes."""
    return _raw(tensor)


def pieces(raw: np.ndarray) -> np.ndarray:
    """Bytes as float32-held 16-bit pieces (an odd count gets one zero byte)."""
    if raw.size % 2:
        raw = np.concatenate([raw, np.zeros(1, np.uint8)])
    return raw.view("<u2").astype(np.float32)


def unpieces(flat: np.ndarray, nbytes: int) -> np.ndarray:
    """Summed pieces that each came from one rank back to ``nbytes`` bytes."""
    whole = _pieces(flat)
    if whole.size and whole.max() >= PIECE:
        raise ValueError("a copied piece exceeds 16 bits: more than one rank contributed it")
    return whole.astype("<u2").view(np.uint8)[:nbytes]


def store_raw(tensor: torch.Tensor, raw: np.ndarray) -> None:
    """Write bytes (as ``raw_bytes`` gave them) into ``tensor``, bit for bit, on its device."""
    target_dtype = torch.uint8 if tensor.dtype == torch.bool else tensor.dtype
    decoded = torch.from_numpy(np.ascontiguousarray(raw).copy()).view(target_dtype).reshape(tensor.shape)
    with torch.no_grad():
        tensor.copy_(decoded)


def bits_size(tensor: torch.Tensor) -> int:
    """Float32 elements ``bits(tensor)`` has."""
    nbytes = tensor.numel() * (1 if tensor.dtype == torch.bool else tensor.element_size())
    return (nbytes + 1) // 2


def _pieces(flat: np.ndarray) -> np.ndarray:
    """Summed pieces back to integers; they must be whole and non-negative (else the sum was not exact)."""
    pieces = np.rint(flat)
    if pieces.size and (pieces.min() < 0 or not np.array_equal(pieces, flat)):
        raise ValueError("the node returned pieces that are not whole: a copy was summed with another value")
    return pieces.astype(np.int64)


def store_bits(tensor: torch.Tensor, flat: np.ndarray) -> None:
    """Write pieces that each came from one rank (a copy) into ``tensor``, bit for bit."""
    pieces = _pieces(flat)
    if pieces.size and pieces.max() >= PIECE:
        raise ValueError("a copied piece exceeds 16 bits: more than one rank contributed it")
    raw = pieces.astype("<u2").view(np.uint8)
    target = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor
    nbytes = target.numel() * target.element_size()
    decoded = torch.from_numpy(raw[:nbytes].copy()).view(target.dtype).reshape(tensor.shape)
    with torch.no_grad():
        tensor.copy_(decoded)


def int_sum_bits(tensor: torch.Tensor) -> np.ndarray:
    """An integer (or bool) tensor widened to int64 and encoded as bits, for an exact sum."""
    return bits(tensor.detach().to(torch.int64))


def store_int_sum(tensor: torch.Tensor, flat: np.ndarray) -> None:
    """Re-assemble summed int64 pieces (four per element, carries included) into ``tensor``."""
    pieces = _pieces(flat).reshape(-1, 4)
    total = np.zeros(pieces.shape[0], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(4):
            total += pieces[:, j].astype(np.uint64) << np.uint64(16 * j)
    result = torch.from_numpy(total.view(np.int64).copy()).reshape(tensor.shape)
    with torch.no_grad():
        tensor.copy_(result.to(tensor.dtype))
