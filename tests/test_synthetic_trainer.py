"""The synthetic trainer's gradients: every DC's sum is checkable exactly, and corruption is caught."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from netstorm.bench.loopback import node_processes
from netstorm.trainers.launch import Trainers, local_cluster
from netstorm.trainers.synthetic import GradientPattern, _Clock, _overlapped_iteration, main, model_layers

# Layers straddling the pattern periods (65521 / 65519) and a scalar-like one.
LAYERS = [("conv.weight", (3, 5, 7)), ("fc.weight", (70_000,)), ("fc.bias", (1,)), ("head", (257, 300))]


def numpy_sum(pattern: GradientPattern, dcs: list[int], iteration: int) -> dict[str, np.ndarray]:
    """The reference: each DC's gradient built separately, summed in float64."""
    total = {name: np.zeros(shape, dtype=np.float64) for name, shape in LAYERS}
    for dc in dcs:
        grads = pattern.allocate()
        pattern.fill(dc, iteration, grads)
        for name in total:
            total[name] += grads[name]
    return {name: value.astype(np.float32) for name, value in total.items()}


@pytest.fixture(scope="module")
def pattern() -> GradientPattern:
    return GradientPattern(LAYERS)


def test_gradients_are_small_integers_that_differ_by_dc_and_iteration(pattern: GradientPattern) -> None:
    g1, g2, g1_next = pattern.allocate(), pattern.allocate(), pattern.allocate()
    pattern.fill(1, 0, g1)
    pattern.fill(2, 0, g2)
    pattern.fill(1, 1, g1_next)
    for name, _ in LAYERS:
        assert np.array_equal(g1[name], np.round(g1[name]))
    assert not np.array_equal(g1["head"], g2["head"])
    assert not np.array_equal(g1["head"], g1_next["head"])
    # Distinct values everywhere, not a constant: the pattern locates misplaced chunks.
    assert len(np.unique(g1["fc.weight"])) > 10


@pytest.mark.parametrize("iteration", [0, 1, 2, 7])
def test_true_sum_is_exact_and_reveals_the_dc_ids(pattern: GradientPattern, iteration: int) -> None:
    dcs = [1, 4, 7, 9]
    result = numpy_sum(pattern, dcs, iteration)
    verdict = pattern.check(iteration, len(dcs), result)
    assert verdict.exact, verdict.error
    assert verdict.members_sum == sum(dcs)
    expected = pattern.expected(iteration, len(dcs), sum(dcs))
    for name, _ in LAYERS:
        assert np.array_equal(expected[name], result[name])


def test_a_missing_contribution_is_caught(pattern: GradientPattern) -> None:
    result = numpy_sum(pattern, [1, 2], 3)
    assert not pattern.check(3, 3, result).exact


def test_a_doubled_contribution_is_caught(pattern: GradientPattern) -> None:
    result = numpy_sum(pattern, [1, 2, 2], 3)
    verdict = pattern.check(3, 3, result, members_sum=6.0)
    assert not verdict.exact
    assert "changed from 6 to 5" in verdict.error


def test_a_stale_iteration_is_caught(pattern: GradientPattern) -> None:
    assert not pattern.check(4, 3, numpy_sum(pattern, [1, 2, 3], 3)).exact


def test_a_chunk_at_the_wrong_offset_is_caught(pattern: GradientPattern) -> None:
    result = numpy_sum(pattern, [1, 2, 3], 5)
    flat = result["fc.weight"]
    first, second = flat[:1000].copy(), flat[30_000:31_000].copy()
    flat[:1000], flat[30_000:31_000] = second, first
    verdict = pattern.check(5, 3, result)
    assert not verdict.exact
    assert verdict.error.startswith("fc.weight[")


def test_one_wrong_element_is_caught_and_named(pattern: GradientPattern) -> None:
    result = numpy_sum(pattern, [1, 2, 3], 2)
    result["head"][256, 299] += 1
    verdict = pattern.check(2, 3, result)
    assert not verdict.exact
    assert verdict.error.startswith(f"head[{257 * 300 - 1}]")


def test_wrong_dtype_shape_or_missing_layer_is_reported(pattern: GradientPattern) -> None:
    result = numpy_sum(pattern, [1, 2], 0)
    assert "float32" in pattern.check(0, 2, {**result, "fc.bias": np.zeros(2, np.float32)}).error
    assert "float64" in pattern.check(0, 2, {**result, "fc.bias": np.zeros(1, np.float64)}).error
    del result["head"]
    assert "lacks" in pattern.check(0, 2, result).error


def test_model_layers_come_from_the_model_catalogue() -> None:
    alexnet = model_layers("alexnet")
    assert alexnet[0] == ("features.0.weight", (64, 3, 11, 11))
    assert sum(int(np.prod(shape)) for _, shape in alexnet) == 61_100_840
    assert model_layers("25M") == [("params", (25_000_000,))]
    with pytest.raises(ValueError, match="unknown model"):
        model_layers("vgg")


def test_a_trainer_without_a_node_says_so_in_its_output_file(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    code = main(["--socket", str(tmp_path / "nowhere.sock"), "--model", "10", "--iterations", "2", "--dc", "4",
                 "--out", str(out)])
    assert code == 1
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["exact"] is False and record["dc"] == 4
    assert record["error"].startswith("NodeGone") and "nowhere.sock" in record["error"]


def test_bad_options_are_refused_before_connecting(tmp_path: Path) -> None:
    for bad in (["--model", "vgg"], ["--iterations", "-1"], ["--max-failures", "0"], ["--dc", "-2"]):
        assert main(["--socket", str(tmp_path / "nowhere.sock"), *bad]) == 2


@pytest.mark.slow
def test_trainers_check_every_sum_exactly_and_stop_when_their_node_dies(tmp_path: Path) -> None:
    # chunk_size 40k splits the 150k-parameter layer into chunks that travel separately.
    iterations = 8
    with local_cluster(3, tmp_path / "run", flags=["--chunk-size", "40000"], ready_timeout=90) as cluster:
        argvs = [[sys.executable, "-m", "netstorm.trainers.synthetic", "--socket", cluster.socket(node),
                  "--model", "150k", "--iterations", str(iterations), "--compute-s", "0.2", "--timeout", "60",
                  "--max-failures", "3", "--retry-s", "0.1"] for node in cluster.node_ids]
        records: dict[int, list[dict[str, Any]]] = {1: [], 2: [], 3: []}
        codes: dict[int, int | None] = {}
        with Trainers(argvs, tmp_path) as trainers:
            killed = False
            while len(codes) < 3:
                line = trainers.next_line(timeout=90)
                node = cluster.node_ids[line.index]
                if line.record is None:
                    codes[node] = line.returncode
                    continue
                records[node].append(line.record)
                if not killed and all(len(r) >= 2 for r in records.values()):
                    # Every DC finished iteration 1. DC 3's node dies now (and netstorm local, seeing a
                    # child die, stops the others): iteration 2 can complete nowhere.
                    os.kill(node_processes(cluster.process.pid)[3], signal.SIGKILL)
                    killed = True
    assert codes == {1: 1, 2: 1, 3: 1}
    for node, got in records.items():
        assert [(r["iteration"], r["exact"], r["workers"]) for r in got[:2]] == [(0, True, 3), (1, True, 3)], got
        assert all(r["dc"] == node and r["sync_s"] <= r["seconds"] for r in got), got
        assert all(r["seconds"] >= 0.2 for r in got[:2]), got
        # Then three failed iterations in a row, each naming its error, and the trainer stops.
        assert [(r["iteration"], r.get("failed")) for r in got[2:]] == [(2, True), (3, True), (4, True)], got
        assert all(r["exact"] is False and r["error"] for r in got[2:]), got


class _RecordingStore:
    """A stand-in for the node's client that records when each verb is called (the overlap's schedule is
    what is under test here; the real node's sums are checked by the cluster test below)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float]] = []
        self.pushed: dict[str, np.ndarray] = {}

    def push(self, name: str, value: np.ndarray) -> None:
        self.calls.append(("push", name, time.perf_counter()))
        self.pushed[name] = value.copy()

    def pull(self, name: str, average: bool = False) -> np.ndarray:
        self.calls.append(("pull", name, time.perf_counter()))
        return self.pushed[name]


def test_overlap_pushes_each_layer_during_backward_last_layer_first() -> None:
    layers: list[tuple[str, tuple[int, ...]]] = [("a", (100,)), ("b", (300,)), ("c", (600,))]
    pattern = GradientPattern(layers)
    grads = pattern.allocate()
    store = _RecordingStore()
    compute_s = 0.6
    clock = _Clock(time.perf_counter())
    result = _overlapped_iteration(store, pattern, grads, 3, 2, compute_s, clock)
    pushes = [(name, t - clock.start) for verb, name, t in store.calls if verb == "push"]
    pulls = [name for verb, name, _ in store.calls if verb == "pull"]
    assert [name for name, _ in pushes] == ["c", "b", "a"]
    assert pulls == ["a", "b", "c"] and store.calls[3][0] == "pull"
    # Forward is a third (0.2 s); backward's 0.4 s is shared by size, last layer first: c after 0.24 s of
    # it, b after 0.36 s, a at the end. No push comes before its share has passed.
    for (_, at), due in zip(pushes, [0.2 + 0.4 * 0.6, 0.2 + 0.4 * 0.9, 0.6], strict=True):
        assert at >= due - 1e-3
    assert pushes[0][1] < compute_s  # the first push is well inside the compute time
    expected = pattern.allocate()
    pattern.fill(3, 2, expected)
    assert all(np.array_equal(result[name], expected[name]) for name, _ in layers)
    assert 0 <= clock.blocked < time.perf_counter() - clock.start


@pytest.mark.slow
def test_overlapped_trainers_sum_exactly_through_real_nodes(tmp_path: Path) -> None:
    iterations = 4
    with local_cluster(3, tmp_path / "run", flags=["--chunk-size", "40000"], ready_timeout=90) as cluster:
        argvs = [[sys.executable, "-m", "netstorm.trainers.synthetic", "--socket", cluster.socket(node),
                  "--model", "150k/6", "--overlap", "--iterations", str(iterations), "--compute-s", "0.3",
                  "--timeout", "60", "--max-failures", "1"] for node in cluster.node_ids]
        records: dict[int, list[dict[str, Any]]] = {n: [] for n in cluster.node_ids}
        codes: dict[int, int | None] = {}
        with Trainers(argvs, tmp_path) as trainers:
            while len(codes) < 3:
                line = trainers.next_line(timeout=90)
                node = cluster.node_ids[line.index]
                if line.record is None:
                    codes[node] = line.returncode
                else:
                    records[node].append(line.record)
    assert codes == {n: 0 for n in cluster.node_ids}
    for node, got in records.items():
        assert [(r["iteration"], r["exact"], r["workers"]) for r in got] == [(k, True, 3) for k in range(iterations)]
        assert all(r["dc"] == node and r["seconds"] >= 0.3 and 0 <= r["sync_s"] <= r["seconds"] for r in got), got
