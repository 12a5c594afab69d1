"""A compressed synthetic trainer's memory: its traced peak per parameter, through a node stand-in.

The stand-in sums in the client's own shared memory (N identical contributions), so the rounds, the
client's conversions and the trainer's checks run as against a node. tracemalloc counts numpy's
allocations exactly: the bound is in bytes per parameter and fails if a float64 model-sized array
(8 bytes a parameter) came back beside what the rounds hold."""

from __future__ import annotations

import argparse
import io
import json
import tracemalloc
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import pytest

import netstorm
from netstorm import client as node_client
from netstorm import trainer_wire as tw
from netstorm.trainers import synthetic

CONTRIBUTORS = 9
BYTES_PER_PARAMETER = 70
"""Above what top-k (64) and FediAC (66.5) hold at their peak, below that plus one float64 copy."""


class _LoopbackClient:
    """A node client whose node is its own shared memory: each sum is N times this DC's push."""

    keeps_results = True

    def __init__(self) -> None:
        self.registry = node_client.Registry(inline=False)
        self.num_workers, self.node_id, self.wan_bytes, self.gia_threshold = CONTRIBUTORS, 3, 0, 0

    def init(self, tensors: Mapping[str, np.ndarray], compression: str = "none", votes: int = 0, bits: int = 0,
             gia_reuse: int = 1) -> dict[str, np.ndarray]:
        _, _, path = self.registry.prepare_init(tensors, compression, votes, bits, gia_reuse)
        node_client.release_init(path)
        return self.registry.accept_init(tw.InitReply(3, 0, CONTRIBUTORS, "loopback"), list(tensors), b"")

    def push_pull(self, tensors: Mapping[str, np.ndarray], average: bool = False,
                  keep: Collection[str] | None = None) -> dict[str, np.ndarray]:
        names, _ = self.registry.prepare_push(tensors)
        assert self.registry.shm is not None
        self.registry.shm *= np.float32(CONTRIBUTORS)
        return self.registry.accept_result(tw.PullReply(1, names, CONTRIBUTORS), names, b"", keep)

    def close(self) -> None:
        self.registry.close()


@pytest.mark.parametrize("method", ["topk", "fediac"])
def test_a_compressed_trainer_holds_no_extra_model_sized_buffer(method: str, monkeypatch: Any) -> None:
    monkeypatch.setattr(netstorm, "connect", lambda *args, **kwargs: _LoopbackClient())
    parser = argparse.ArgumentParser()
    synthetic.add_arguments(parser)
    model = "2M"
    args = parser.parse_args(["--socket", "unused", "--model", model, "--iterations", "3", "--compression", method,
                              "--contributor-sum", str(sum(range(CONTRIBUTORS)))])
    parameters = synthetic.GradientPattern(synthetic.model_layers(model)).parameters
    out = io.StringIO()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        assert synthetic.run(args, out) == 0
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2]
    assert all(r["gia"] > 0 or r["dense"] for r in records), records
    assert peak / parameters < BYTES_PER_PARAMETER, f"{peak / parameters:.1f} bytes per parameter"


@pytest.mark.parametrize("inline", [False, True])
def test_kept_results_and_the_initial_model_are_the_values_a_full_result_holds(inline: bool) -> None:
    size = node_client._ROUND_BLOCK + 3   # integer sums converted across a block boundary
    rng = np.random.default_rng(7)
    tensors: dict[str, np.ndarray] = {"w": rng.standard_normal(size).astype(np.float32),
                                      "votes": np.zeros(size, dtype=np.uint8),
                                      "values": np.zeros(size, dtype=np.int16)}
    node: dict[str, np.ndarray] = {"w": tensors["w"], "votes": rng.integers(0, 9, size).astype("<f4"),
            "values": rng.integers(-300, 300, size).astype("<f4")}
    node["votes"][0] = -0.0
    registry = node_client.Registry(inline=inline)
    try:
        _, _, path = registry.prepare_init(tensors)
        node_client.release_init(path)
        assert registry.layout is not None
        sums = np.concatenate([node[spec.name] for spec in registry.layout.tensors])   # the layout's order
        if not inline:
            assert registry.shm is not None
            registry.shm[:] = sums
        # inline, the node answers in the order of the names asked for
        payload = b"" if not inline else b"".join(node[name].tobytes() for name in tensors)
        model = registry.accept_init(tw.InitReply(0, 0, 1, "x"), list(tensors), payload)
        assert np.array_equal(model["w"], tensors["w"])
        for name in ("votes", "values"):
            assert model[name].dtype == np.int64 and np.array_equal(model[name], np.rint(node[name]).astype(np.int64))
        # the kept initial model offers the very bytes the full int64 result would
        want = b"".join(np.ascontiguousarray(model[spec.name], dtype="<f4").tobytes()
                        for spec in registry.layout.tensors)
        assert registry.model_payload(tw.ModelWanted(0))[1] == want
        kept = registry.accept_result(tw.PullReply(1, tuple(tensors), 1), tuple(tensors), payload, ("values",))
        assert list(kept) == ["values"] and np.array_equal(kept["values"], model["values"])
    finally:
        registry.close()
