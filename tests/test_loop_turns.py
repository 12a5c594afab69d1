"""A model-sized push and pull at a node let its event loop turn between pieces (the heartbeat shares
that loop): two nodes in-process on loopback, the ranks' shell of each driven directly, and a task that
counts the loop's turns. A push goes into the core chunk by chunk and a pull reads the sum in pieces of at
most ``pieces.PIECE`` elements (a large tensor that shares a chunk is summed in such pieces too), with at
least one turn of the loop between two of them; sums stay exact.
Asserted on the structure (pieces and turns), not on how long anything took."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import uvloop

from netstorm.config import Config
from netstorm.layout import TensorSpec
from netstorm.planning.plan import plan
from node import pieces
from node.ranks import Ranks
from tests.dataplane import cluster

CHUNK = 1000
PIECE = 700  # not a multiple of CHUNK: pieces and chunks are independent
CONFIG = Config(chunk_size=CHUNK, iteration_timeout=20.0, connect_timeout=5.0)
POLICY = plan({(1, 2): 10.0, (2, 1): 10.0}, topology="fapt", version=0)
SPECS = [TensorSpec("big.weight", (50, 400), "float32"), TensorSpec("other.weight", (5_000,), "float32"),
         TensorSpec("small.bias", (7,), "float32"),
         TensorSpec("shared.weight", (900,), "float32")]  # above PIECE, and it shares a chunk with small.bias


class Turns:
    """Counts the turns of the running loop (a task that yields at once, every turn)."""

    def __init__(self) -> None:
        self.count = 0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            self.count += 1
            await asyncio.sleep(0)

    def __enter__(self) -> Turns:
        self._task = asyncio.get_running_loop().create_task(self._tick())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


def test_a_large_push_and_pull_turn_the_loop_between_pieces_and_the_sum_is_exact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pieces, "PIECE", PIECE)

    async def main() -> None:
        async with cluster([1, 2], CONFIG, lambda iteration: POLICY) as nodes:
            layouts = await asyncio.gather(*(node.register(SPECS) for node in nodes.values()))
            layout = layouts[0]
            total = layout.total
            rng = np.random.default_rng(7)
            flat = {dc: rng.integers(-99, 99, total).astype(np.float32) for dc in nodes}
            ranks = {dc: Ranks(node) for dc, node in nodes.items()}
            rank_ids = {}
            for dc, shell in ranks.items():
                rank_ids[dc] = shell.join(f"trainer of {dc}")
                shell.start(rank_ids[dc], layout, replacement=False)
            keys = list(range(len(layout.tensors)))
            turns = Turns()
            parts: list[tuple[int, int, int]] = []  # (turn, key, elements) of each contribution into node 1's core
            core = nodes[1].core
            contribute_part = core.contribute_part
            contribute_many = core.contribute_many

            def counted_part(key: int, iteration: int, part: int, values: Any, *rest: Any) -> Any:
                parts.append((turns.count, key, values.size))
                return contribute_part(key, iteration, part, values, *rest)

            def counted_many(iteration: int, items: Any, *rest: Any) -> Any:
                parts.append((turns.count, -1, sum(v.size for _, v in items)))  # one event of the core
                return contribute_many(iteration, items, *rest)
            contribute_piece = core.contribute_piece

            def counted_piece(key: int, iteration: int, start: int, values: Any) -> None:
                parts.append((turns.count, key, values.size))
                contribute_piece(key, iteration, start, values)
            monkeypatch.setattr(core, "contribute_piece", counted_piece)
            monkeypatch.setattr(core, "contribute_part", counted_part)
            monkeypatch.setattr(core, "contribute_many", counted_many)
            reads: dict[int, list[tuple[int, int]]] = {dc: [] for dc in nodes}
            out = {dc: np.full(total, np.nan, np.float32) for dc in nodes}

            def sink_of(dc: int) -> Callable[[int, int, np.ndarray], None]:
                def sink(key: int, start: int, values: np.ndarray) -> None:
                    reads[dc].append((turns.count, values.size))
                    begin = layout.offsets[key] + start
                    out[dc][begin:begin + values.size] = values
                return sink

            with turns:
                async def one(dc: int) -> None:
                    values = {k: flat[dc][layout.key_slice(k)] for k in keys}
                    await ranks[dc].push(rank_ids[dc], layout, values)
                    await ranks[dc].pull(rank_ids[dc], layout, keys, sink_of(dc))
                await asyncio.gather(*(one(dc) for dc in nodes))
            want = flat[1] + flat[2]
            for dc in nodes:
                np.testing.assert_array_equal(out[dc], want)
            # the push: each large tensor chunk by chunk (those filling their chunks alone) or in pieces
            # (the one sharing a chunk), the small one at once, a turn of the loop between two of one tensor
            assert sum(size for _, _, size in parts) == total
            assert [size for _, key, size in parts if key == -1] == [7]  # small.bias, alone in its event
            assert sorted(size for _, key, size in parts if key != -1) == [200, 700] + [1000] * 25
            assert all(a < b for (a, _, _), (b, _, _) in itertools.pairwise(parts))  # a turn between any two
            for dc in nodes:
                sizes = [size for _, size in reads[dc]]
                assert sum(sizes) == total and max(sizes) <= PIECE
                assert len(sizes) >= -(-total // PIECE)
                # the small tensor shares a piece with its neighbour: no turn between them, one after
                turns_at = [turn for turn, _ in reads[dc]]
                between = sum(a < b for a, b in itertools.pairwise(turns_at))
                assert between >= len(sizes) - 2
                assert turns_at == sorted(turns_at)

    uvloop.run(main())
