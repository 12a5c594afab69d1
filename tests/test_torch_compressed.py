"""Compression under DDP: bucket rounds with error feedback per bucket, and compressed DDP over a cluster.

The unit tests drive ``BucketRounds`` of three ranks against an in-process sum (what the nodes compute:
integers summed exactly, floats as float32); the end-to-end tests train with the torch-ddp trainer on a
``netstorm local`` cluster of 3 DCs and compare every DC's parameters after every step.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pytest

from netstorm.compression.options import CompressionOptions
from netstorm.trainers.launch import Trainers, collect, local_cluster, torch_ddp_args

if TYPE_CHECKING:
    from netstorm.torch.compressed import BucketRounds

pytestmark = pytest.mark.torch  # netstorm.torch imports torch, even for its torch-free modules

ROUND = "netstorm.torch.round"
Tensors = dict[str, np.ndarray]


def _sum(pushes: list[Tensors]) -> Tensors:
    out: Tensors = {}
    for name in pushes[0]:
        if np.issubdtype(pushes[0][name].dtype, np.integer):
            out[name] = np.sum([p[name].astype(np.int64) for p in pushes], axis=0)
        else:
            out[name] = np.asarray(np.sum([p[name].astype(np.float32) for p in pushes], axis=0, dtype=np.float32))
    return out


def _ranks(options: CompressionOptions, elements: int, n: int = 3) -> list[BucketRounds]:
    from netstorm.torch.compressed import BucketRounds

    ranks = [BucketRounds(options, ROUND, elements, seed=0) for _ in range(n)]
    for node_id, rank in enumerate(ranks, start=1):
        rank.registered()
        rank.start(n, node_id)
    return ranks


def _round(ranks: list[BucketRounds], key: tuple[int, ...], payloads: list[np.ndarray]) -> list[np.ndarray]:
    """Every rank's rounds for one bucket piece, summed in process as the nodes would."""
    steps: list[Generator[Tensors, Tensors, np.ndarray]] = [
        r.iteration(key, p) for r, p in zip(ranks, payloads, strict=True)]
    pushes = [next(s) for s in steps]
    while True:
        summed = _sum(pushes)
        results: list[np.ndarray] = []
        nxt: list[Tensors] = []
        for s in steps:
            try:
                nxt.append(s.send(summed))
            except StopIteration as done:
                results.append(done.value)
        if results:
            assert len(results) == len(steps), "every rank ends in the same round"
            return results
        pushes = nxt


def _payloads(seed: int, elements: int, n: int = 3) -> list[np.ndarray]:
    gen = np.random.default_rng(seed)
    return [(gen.standard_normal(elements) * gen.exponential(1.0, elements)).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("method", ["fediac", "topk"])
def test_every_rank_decodes_the_same_sum_of_a_bucket(method: Literal["fediac", "topk"]) -> None:
    options = CompressionOptions(method, k=0.1, bits=10 if method == "fediac" else 0, votes=1)
    ranks = _ranks(options, 500)
    for it in range(3):
        results = _round(ranks, (0, 500, 0), _payloads(it, 500))
        for other in results[1:]:
            assert np.array_equal(other, results[0])
        assert np.count_nonzero(results[0]) > 0


def test_error_feedback_is_kept_per_bucket_piece() -> None:
    """Top-k is deterministic: bucket A's results must not change when bucket B runs in between, which
    they would if B's leftovers were added to A's gradient."""
    options = CompressionOptions("topk", k=20)
    a1, a2, b = _payloads(1, 300), _payloads(2, 300), _payloads(3, 300)
    alone = _ranks(options, 300)
    first = _round(alone, (0, 300, 0), a1)
    second = _round(alone, (0, 300, 0), a2)
    mixed = _ranks(options, 300)
    assert np.array_equal(_round(mixed, (0, 300, 0), a1)[0], first[0])
    _round(mixed, (1, 300, 0), b)
    assert np.array_equal(_round(mixed, (0, 300, 0), a2)[0], second[0])
    # and the residual is what was not sent: sum of (sent + residual) == sum of (update + old residual)
    rank0 = alone[0]
    residual = rank0.residuals[(0, 300, 0)]
    assert np.count_nonzero(residual) > 0
    union = np.flatnonzero(second[0])
    outside = np.setdiff1d(np.arange(300), union)
    # top-k sends float32 values: only their rounding is left where it sent, the whole value elsewhere
    assert np.max(np.abs(residual[union])) < 1e-6 < np.min(np.abs(residual[outside]))


def test_fediac_with_b_derived_starts_with_one_dense_round_then_sends_integers() -> None:
    ranks = _ranks(CompressionOptions("fediac", k=0.2), 400)
    payloads = _payloads(5, 400)
    dense = _round(ranks, (0, 400, 0), payloads)
    want = np.sum(payloads, axis=0, dtype=np.float32)
    assert np.array_equal(dense[0], want)  # the first round is the exact float32 sum
    assert ranks[0].last.dense
    sparse = _round(ranks, (0, 400, 0), payloads)
    assert ranks[0].last.round_trips == 2 and ranks[0].last.gia > 0
    assert all(np.array_equal(s, sparse[0]) for s in sparse)


def test_a_reused_gia_belongs_to_its_bucket_piece() -> None:
    """With fediac_gia_reuse each bucket piece keeps its own GIA and m: a reused iteration of bucket A
    sends values at A's indices, however many of B's iterations ran in between, at every rank alike."""
    options = CompressionOptions("fediac", k=0.1, bits=12, votes=2, gia_reuse=2)
    ranks = _ranks(options, 400)
    a, b = (0, 400, 0), (1, 400, 0)
    first = _round(ranks, a, _payloads(1, 400))
    assert ranks[0].last.round_trips == 2 and not ranks[0].last.reused
    gia_a = ranks[0].states[a].gia
    assert gia_a is not None and set(np.flatnonzero(first[0])) <= set(gia_a)
    _round(ranks, b, _payloads(2, 400))
    assert ranks[0].last.round_trips == 2  # B has no GIA yet: it votes
    gia_b = ranks[0].states[b].gia
    assert gia_b is not None and not np.array_equal(gia_a, gia_b)
    again = _round(ranks, a, _payloads(3, 400))
    assert all(r.last.reused and r.last.round_trips == 1 and r.last.gia == ranks[0].last.gia for r in ranks)
    assert all(np.array_equal(other, again[0]) for other in again)
    # values land only on A's kept GIA (a reused value may round to 0, so a subset)
    assert set(np.flatnonzero(again[0])) <= set(gia_a) and np.count_nonzero(again[0]) > 0
    _round(ranks, a, _payloads(4, 400))
    assert ranks[0].last.round_trips == 2  # A's GIA served its two iterations: A votes again


def test_bucket_rounds_refuse_a_dense_method() -> None:
    from netstorm.torch.compressed import BucketRounds

    with pytest.raises(ValueError, match="sparse"):
        BucketRounds(CompressionOptions("fp16"), ROUND, 10)


def _train(tmp_path: Path, method: str, *, hook: str = "default", iterations: int = 3,
           extra: tuple[str, ...] = ()) -> tuple[list[list[dict[str, Any]]], list[np.ndarray]]:
    run = tmp_path / f"run-{method}-{hook}"
    saved = tmp_path / f"saved-{method}-{hook}"
    saved.mkdir()
    with local_cluster(3, run, flags=["--compression", method], ready_timeout=90) as cluster:
        argvs = [[sys.executable, *torch_ddp_args(
            "netstorm", "shapes", rank=i, world=3, dc=node, iterations=iterations, out=run / f"trainer-{i}.jsonl",
            socket=cluster.socket(node), compression=["--compression", method, *extra]),
            "--digest", "--save", str(saved), "--comm-hook", hook] for i, node in enumerate(cluster.node_ids)]
        with Trainers(argvs, run) as trainers:
            collect(trainers, timeout=180)
    records = [[json.loads(line) for line in (run / f"trainer-{i}.jsonl").read_text().splitlines()] for i in range(3)]
    return records, [np.load(saved / f"rank-{i}.npy") for i in range(3)]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fediac", "topk", "fp16"])
def test_compressed_ddp_keeps_every_dc_identical_after_every_step(tmp_path: Path, method: str) -> None:
    extra = ("--fediac-k", "0.05") if method != "fp16" else ()
    records, params = _train(tmp_path, method, iterations=4, extra=extra)
    digests = [[r["params_digest"] for r in recs] for recs in records]
    assert len(digests[0]) == 4
    assert digests[1] == digests[0] and digests[2] == digests[0]
    assert len(set(digests[0])) == 4  # every step moved the model
    assert np.array_equal(params[1], params[0]) and np.array_equal(params[2], params[0])
    for recs in records:
        assert all(int(r["wan_bytes"]) > 0 for r in recs)
        assert all(r.get("compression") == method for r in recs)
    if method != "fp16":
        # after the first step (b derived by a dense round for fediac) every step has a vote round
        assert all(int(r["gia"]) > 0 and len(r["round_s"]) == 2 for r in records[0][1:])
        assert all(int(r["round_trips"]) >= 2 for r in records[0][1:])


@pytest.mark.slow
def test_fediac_gia_reuse_under_ddp_skips_every_other_vote_and_keeps_the_dcs_identical(tmp_path: Path) -> None:
    records, params = _train(tmp_path, "fediac", iterations=5, extra=("--fediac-k", "0.05", "--fediac-gia-reuse", "2"))
    assert np.array_equal(params[1], params[0]) and np.array_equal(params[2], params[0])
    for recs in records:
        assert len({r["params_digest"] for r in recs}) == 5
        trips = [int(r["round_trips"]) for r in recs]
        votes = [float(r["round_s"][0]) for r in recs[1:]]
        # step 0 is dense (b derived); then a vote (steps 1, 3), and its GIA reused once (steps 2, 4);
        # step 1 also carries DDP's broadcast of its rebuilt buckets
        assert trips[2] == 1 and trips[3] == 2 and trips[4] == 1, trips
        assert votes[1] == 0.0 and votes[3] == 0.0 and votes[0] > 0.0 and votes[2] > 0.0, votes
        assert [r["gia"] for r in recs[1:]] == [r["gia"] for r in records[0][1:]]


@pytest.mark.slow
def test_the_compressed_hook_without_compression_matches_ddps_own_all_reduce(tmp_path: Path) -> None:
    _, plain = _train(tmp_path, "none", hook="default")
    _, hooked = _train(tmp_path, "none", hook="compressed")
    assert np.array_equal(hooked[1], hooked[0]) and np.array_equal(hooked[2], hooked[0])
    # DDP divides before the sum, the hook after it: the same mean up to float32 rounding
    np.testing.assert_allclose(hooked[0], plain[0], rtol=1e-5, atol=1e-6)
    assert not np.allclose(plain[0], _train(tmp_path, "topk", extra=("--fediac-k", "0.01"))[1][0], atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fediac", "fp16"])
def test_every_other_collective_stays_exact_under_compression(tmp_path: Path, method: str) -> None:
    """Broadcasts, gathers, integer sums, MIN and MAX (on the job and on a partition of unequal groups) and
    barriers bypass the compression (with fp16, in the int32 lane)."""
    from tests.test_torch_backend import ROOT, Ranks, env_rank, free_port

    with local_cluster(3, tmp_path / "run", flags=["--compression", method], ready_timeout=90) as cluster:
        argv = [sys.executable, str(ROOT / "tests" / "torch_ranks_compressed.py")]
        port = free_port()
        ranks = Ranks([argv] * 3, [env_rank(r, 3, port, NETSTORM_SOCKET=cluster.socket(r + 1),
                                            NETSTORM_COMPRESSION=method) for r in range(3)], tmp_path)
        try:
            reports = dict(ranks.until(lambda i, rec: "ok" in rec, "a rank's report", within=240) for _ in range(3))
            codes = ranks.wait(within=60)
        finally:
            ranks.stop()
    assert codes == [0, 0, 0], [log.read_text()[-2000:] for log in ranks.logs]
    assert all(r["ok"] and r["checks"] == 21 for r in reports.values()), reports
