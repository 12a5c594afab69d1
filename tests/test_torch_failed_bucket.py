"""A compressed bucket whose round fails under DDP's stage is undone, every piece once, at every rank: the
buckets after it decode exactly what a run without the failed one decodes, and each bucket piece's
residual, kept GIA and random draws are those of that run.

Three ranks' stages run on threads against an in-process node (``Hub``): each node iteration sums the
three ranks' pushes as the nodes do (integers exactly, floats in float32), and a chosen node iteration
fails at every rank, either with the node's error or as a sum that lost a DC (``GroupIncomplete``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from netstorm.compression.options import CompressionOptions
from netstorm.errors import IterationError

pytestmark = pytest.mark.torch  # netstorm.torch imports torch

Tensors = dict[str, np.ndarray]
N = 3
ROUND = 64
A, B = (0, 150), (1, 64)
"""Two buckets (DDP's index, size): A takes three pieces of the round (64, 64, 22), B one."""


class Hub:
    """The DCs' nodes in one process: rank r's k-th push sums with the others' k-th; ``failing`` maps a
    node iteration to how it fails at every rank ("error": the node's error; "short": a sum of two DCs)."""

    def __init__(self, failing: dict[int, str] | None = None) -> None:
        self.failing = dict(failing or {})
        self.slots: list[Tensors] = [{} for _ in range(N)]
        self.barrier = threading.Barrier(N, timeout=60)

    def client(self, rank: int) -> Client:
        return Client(self, rank)


class Client:
    """One rank's node client (the part ``Stage`` uses)."""

    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub = hub
        self.rank = rank
        self.node_id = rank + 1
        self.iteration = -1
        self.short = False

    @property
    def num_workers(self) -> int:
        return N - 1 if self.short else N

    @property
    def contributors(self) -> tuple[int, ...]:
        return tuple(range(1, N)) if self.short else tuple(range(1, N + 1))

    def init(self, tensors: Tensors, **_: Any) -> Tensors:
        return {name: t.copy() for name, t in tensors.items()}

    def push_pull(self, tensors: Tensors, average: bool = False) -> Tensors:
        hub = self.hub
        hub.slots[self.rank] = {name: np.asarray(t).copy() for name, t in tensors.items()}
        hub.barrier.wait()
        total = _sum(hub.slots)
        hub.barrier.wait()  # every rank has read the slots before any writes the next
        self.iteration += 1
        how = hub.failing.get(self.iteration)
        self.short = how == "short"
        if how == "error":
            raise IterationError(f"iteration {self.iteration} failed: node 3 timed out")
        return total

    def close(self) -> None:
        pass


def _sum(pushes: Sequence[Tensors]) -> Tensors:
    out: Tensors = {}
    for name in pushes[0]:
        values = [p[name] for p in pushes]
        if values[0].dtype.kind in "iu":
            out[name] = np.sum([v.astype(np.int64) for v in values], axis=0)
        else:
            out[name] = np.asarray(np.sum(values, axis=0, dtype=np.float32))
    return out


def _stages(options: CompressionOptions, hub: Hub) -> list[Any]:
    from netstorm.torch.stage import Stage

    return [Stage(hub.client(rank), ROUND, options, seed=rank) for rank in range(N)]


def _payload(rank: int, call: int, size: int) -> np.ndarray:
    gen = np.random.default_rng([rank, call, size])
    return (gen.standard_normal(size) * gen.exponential(1.0, size)).astype(np.float32)


def _bucket(stages: list[Any], bucket: tuple[int, int], call: int) -> list[np.ndarray | BaseException]:
    """Every rank's ``reduce_compressed`` of the bucket at once; each rank's sum, or its error."""
    def one(rank: int) -> np.ndarray | BaseException:
        try:
            return np.asarray(stages[rank].reduce_compressed(_payload(rank, call, bucket[1]), bucket))
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(N) as pool:
        return list(pool.map(one, range(N), timeout=120))


def _kept(stage: Any) -> dict[str, Any]:
    """What a rank carries into the next bucket: every piece's state, b, the random generator."""
    rounds = stage.buckets.rounds
    codec = rounds.codec
    rng = getattr(codec, "rng", None)
    return {
        "states": {key: (s.residual.tobytes(), None if s.gia is None else s.gia.tobytes(), s.served, s.peak)
                   for key, s in stage.buckets.states.items()},
        "bits": rounds.bits, "codec": codec is not None,
        "rng": None if rng is None else repr(rng.bit_generator.state),
        "idle": rounds._phase == "idle",
    }


CASES = {
    # name: options, the buckets before the failed one, the failed bucket's node iteration that fails, how
    "fediac-first-votes": (CompressionOptions("fediac", k=0.1, bits=12, votes=2), [A, B], 0, "error"),
    "fediac-second-piece-values": (CompressionOptions("fediac", k=0.1, bits=12, votes=2), [A, B], 3, "error"),
    "fediac-last-piece-votes-short": (CompressionOptions("fediac", k=0.1, bits=12, votes=2), [A, B], 4, "short"),
    # A's GIA kept from its one vote: the failed bucket reuses it, one round a piece (the third fails)
    "fediac-reuse-reused-piece": (CompressionOptions("fediac", k=0.1, bits=12, votes=2, gia_reuse=2), [A], 2,
                                  "error"),
    # A's GIA served its two: the failed bucket votes again (the second piece's values fail)
    "fediac-reuse-voting-piece": (CompressionOptions("fediac", k=0.1, bits=12, votes=2, gia_reuse=2), [A, B, A],
                                  3, "short"),
    # b derived: the first piece is the dense round, done; the second piece's values fail
    "fediac-derived-after-dense": (CompressionOptions("fediac", k=0.1, bits=0, votes=2), [], 2, "error"),
    "topk-second-piece-votes": (CompressionOptions("topk", k=0.1), [A, B], 2, "error"),
    "topk-last-piece-values-short": (CompressionOptions("topk", k=0.1), [A, B], 5, "short"),
}


def _same(got: list[np.ndarray | BaseException], want: list[np.ndarray | BaseException]) -> None:
    for g, w in zip(got, want, strict=True):
        assert isinstance(g, np.ndarray) and isinstance(w, np.ndarray), (g, w)
        assert np.array_equal(g, w)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_failed_bucket_is_undone_and_later_buckets_match_a_run_without_it(case: str) -> None:
    from netstorm.torch.stage import GroupIncomplete

    options, history, offset, how = CASES[case]
    clean = _stages(options, Hub())
    for call, bucket in enumerate(history):
        _bucket(clean, bucket, call)
    at = clean[0].client.iteration + 1 + offset  # a node iteration of the failed bucket
    failing = _stages(options, Hub({at: how}))
    for call, bucket in enumerate(history):
        got = _bucket(failing, bucket, call)
        assert all(isinstance(g, np.ndarray) for g in got), got
    kept = [_kept(s) for s in failing]
    assert kept == [_kept(s) for s in clean]

    errors = _bucket(failing, A, 99)
    want = GroupIncomplete if how == "short" else IterationError
    assert all(isinstance(e, want) for e in errors), errors
    assert failing[0].client.iteration == at, "every rank stopped at the failed node iteration"
    # undone at every rank: each carries what it carried before the failed bucket
    assert [_kept(s) for s in failing] == kept

    for call, bucket in enumerate([A, B, A, A], start=len(history)):
        got, ref = _bucket(failing, bucket, call), _bucket(clean, bucket, call)
        _same(got, ref)
        _same(got, [got[0]] * N)  # the same sum at every rank
        assert [_kept(s) for s in failing] == [_kept(s) for s in clean]
    assert isinstance(got[0], np.ndarray) and np.count_nonzero(got[0]) > 0


@pytest.fixture
def one_rank_group() -> Any:
    """A default process group of one rank (gloo), which the hook's state asks for its rank; each of the
    three hook states below is then the leader of a one-rank DC."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("path", ["backend", "hook"])
def test_the_backend_and_the_hook_fail_a_bucket_with_its_rounds_undone(path: str, request: Any) -> None:
    """DDP's two ways in: the failed bucket's future carries the torch error and every rank's stage
    carries what it did before the bucket (with GIA reuse, so the kept GIA's count is checked too); the
    group stays failed, as a failed backward leaves DDP."""
    import torch

    from netstorm.torch.backend import NetStormBackendError, ProcessGroupNetStorm

    options = CompressionOptions("fediac", k=0.1, bits=12, votes=2, gia_reuse=3)
    hub = Hub()
    stages = _stages(options, hub)
    if path == "backend":
        groups: list[Any] = [ProcessGroupNetStorm(stage, rank, N) for rank, stage in enumerate(stages)]

        def submit(rank: int, tensor: torch.Tensor, bucket: tuple[int, int]) -> Any:
            return groups[rank].allreduce_compressed(tensor, bucket)
    else:
        from netstorm.torch.hook import NetStormHookState

        request.getfixturevalue("one_rank_group")
        groups = [NetStormHookState(stage) for stage in stages]

        def submit(rank: int, tensor: torch.Tensor, bucket: tuple[int, int]) -> Any:
            return groups[rank].submit(tensor, bucket)

    def bucket(bucket: tuple[int, int], call: int) -> list[Any]:
        """Every rank's bucket, submitted at once (each group's worker thread runs its own)."""
        return [submit(r, torch.from_numpy(_payload(r, call, bucket[1])), bucket) for r in range(N)]

    try:
        for call in range(2):  # A's GIA then has served two of its three
            assert all(work.wait() for work in bucket(A, call))
        kept = [_kept(s) for s in stages]
        hub.failing[stages[0].client.iteration + 2] = "short"  # the second piece's reused round
        for work in bucket(A, 99):
            with pytest.raises(NetStormBackendError, match="GroupIncomplete"):
                work.wait()
        assert [_kept(s) for s in stages] == kept
        later = submit(0, torch.zeros(4), B)
        with pytest.raises(NetStormBackendError):  # the group stays failed
            later.wait()
    finally:
        for group in groups:
            group.shutdown() if path == "backend" else group.close()
