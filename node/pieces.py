"""Model-sized work in pieces, with a turn of the node's event loop between them.

A copy, sum or hand-over of a whole tensor of tens of millions of elements holds the loop for seconds on a
busy host, and the heartbeat, which shares that loop with the data path, misses ``heartbeat_timeout``.
Work on at most ``PIECE`` elements runs between two turns of the loop instead."""

from __future__ import annotations

import asyncio

PIECE = 1 << 20
"""Elements handled between two turns of the loop (4 MiB of float32: a few milliseconds of copying)."""


def spans(size: int, piece: int | None = None) -> list[tuple[int, int]]:
    """``[0, size)`` as consecutive ``(start, stop)`` of at most ``piece`` (``PIECE``) elements (one empty
    span for 0)."""
    piece = PIECE if piece is None else piece
    if size <= piece:
        return [(0, size)]
    return [(start, min(start + piece, size)) for start in range(0, size, piece)]


async def turn() -> None:
    """Let every other ready callback of the loop run (heartbeats, peers' frames) before going on."""
    await asyncio.sleep(0)
