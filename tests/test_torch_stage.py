"""A collective of any size through one registered round: pieces, padding, order and the sums."""

from __future__ import annotations

import numpy as np
import pytest

from netstorm.errors import PeerLost
from netstorm.torch.stage import ROUND_NAME, GroupIncomplete, Stage

pytestmark = pytest.mark.torch


class Ranks:
    """Three ranks' clients in one process: rank i's k-th push_pull sums with the others' k-th."""

    def __init__(self, offsets: list[float]) -> None:
        self.offsets = offsets
        self.registered: dict[str, tuple[int, ...]] = {}
        self.pushes: list[np.ndarray] = []

    num_workers = 3
    node_id = 1
    iteration = 0

    def init(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.registered = {name: tuple(t.shape) for name, t in tensors.items()}
        return {name: t.copy() for name, t in tensors.items()}

    def push_pull(self, tensors: dict[str, np.ndarray], average: bool = False) -> dict[str, np.ndarray]:
        values = tensors[ROUND_NAME].copy()
        self.pushes.append(values)
        total = sum(values + np.float32(offset) * (values != 0) for offset in self.offsets)
        self.iteration += 1
        return {ROUND_NAME: (total / np.float32(3)) if average else total}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("size", [0, 1, 9, 10, 11, 35])
def test_a_payload_takes_ceil_size_over_round_iterations_the_last_padded(size: int) -> None:
    ranks = Ranks([0.0, 1.0, 2.0])
    stage = Stage(ranks, 10)
    assert ranks.registered == {ROUND_NAME: (11,)}  # the round and its control word
    payload = np.arange(1, size + 1, dtype=np.float32)
    out = stage.reduce(payload)
    expected = 3 * payload + np.float32(3.0)
    np.testing.assert_array_equal(out, expected)
    iterations = max(1, -(-size // 10))
    assert len(ranks.pushes) == iterations
    assert all(p.size == 11 and p[10] == 0.0 for p in ranks.pushes)  # no collective sets the control word
    pieces = np.concatenate([p[:10] for p in ranks.pushes])
    assert np.array_equal(pieces[:size], payload)
    assert not pieces[size:].any()  # the padding is zeros
    stats = stage.snapshot()
    assert (stats.collectives, stats.iterations, stats.elements) == (1, iterations, size)
    assert stats.padded == iterations * 10 - size


def test_average_divides_by_the_ranks_the_node_counts() -> None:
    stage = Stage(Ranks([0.0, 0.0, 0.0]), 4)
    out = stage.reduce(np.array([3.0, 6.0, 9.0], np.float32), average=True)
    np.testing.assert_allclose(out, [3.0, 6.0, 9.0])


def test_collectives_in_order_each_gets_its_own_iterations() -> None:
    ranks = Ranks([0.0, 0.0, 0.0])
    stage = Stage(ranks, 4)
    a = stage.reduce(np.ones(6, np.float32))
    b = stage.reduce(np.full(2, 2.0, np.float32))
    np.testing.assert_array_equal(a, np.full(6, 3.0))
    np.testing.assert_array_equal(b, np.full(2, 6.0))
    assert len(ranks.pushes) == 3 and stage.snapshot().padded == 2 + 2


def test_a_sum_that_lost_a_dc_is_an_error_not_a_smaller_sum() -> None:
    """The nodes go on without a DC that left; a process group's collective cannot, so the rank raises
    instead of handing DDP the survivors' sum to divide by the whole group's size."""
    ranks = Ranks([0.0, 0.0])
    ranks.contributors = (1, 2, 3)  # type: ignore[attr-defined]
    stage = Stage(ranks, 4)
    np.testing.assert_array_equal(stage.reduce(np.ones(4, np.float32)), np.full(4, 2.0))
    ranks.num_workers = 2  # DC 3 left: the next iteration's sum counts two trainers
    ranks.contributors = (1, 2)  # type: ignore[attr-defined]
    with pytest.raises(GroupIncomplete, match=r"counts 2 trainers \(DCs \[1, 2\]\).*all 3: node 3 left the job"):
        stage.reduce(np.ones(4, np.float32))


class Losing(Ranks):
    """DC 3 is lost in the collective's second piece: that iteration fails (PeerLost), the next count two."""

    def __init__(self) -> None:
        super().__init__([0.0, 0.0, 0.0])
        self.contributors: tuple[int, ...] = (1, 2, 3)
        self.calls = 0

    def push_pull(self, tensors: dict[str, np.ndarray], average: bool = False) -> dict[str, np.ndarray]:
        self.calls += 1
        if self.calls == 3:
            self.offsets = [0.0, 0.0]
            self.num_workers = 2
            self.contributors = (1, 2)
            raise PeerLost("node 3 was declared dead")
        return super().push_pull(tensors, average)


@pytest.mark.parametrize("mode", ["error", "continue"])
def test_with_continue_a_collective_in_flight_runs_again_without_the_lost_dc(mode: str) -> None:
    ranks = Losing()
    stage = Stage(ranks, 4, on_dc_loss=mode)
    np.testing.assert_array_equal(stage.reduce(np.ones(4, np.float32)), np.full(4, 3.0))
    payload = np.arange(1, 9, dtype=np.float32)
    if mode == "error":
        with pytest.raises(PeerLost):
            stage.reduce(payload)
        return
    np.testing.assert_array_equal(stage.reduce(payload), 2 * payload)  # both pieces: the survivors' sum
    stats = stage.snapshot()
    assert (stats.retried, stats.contributors, stats.workers) == (1, (1, 2), 2)
    assert ranks.calls == 1 + 2 + 2


def test_groups_of_a_partition_send_payloads_of_their_own_sizes_in_the_same_iterations() -> None:
    """A gather over a group of two ranks carries twice the pieces of one over a group of one: each group
    keeps its slot, and every rank runs as many node iterations as the largest payload takes."""
    from tests.test_torch_rejoin import Client, Job, together

    job = Job([1, 2, 3])
    stages = [Stage(Client(job, dc), 16) for dc in (1, 2, 3)]
    slots = [0, 1, 0]  # ranks 0 and 2 one group, rank 1 the other
    sizes = [40, 20, 40]
    payloads = [np.arange(n, dtype=np.float32) + 100 * r for r, n in enumerate(sizes)]
    outs = together(*(lambda r=r: stages[r].reduce_slot(payloads[r], slots[r], 2, exact=True) for r in range(3)))
    np.testing.assert_array_equal(outs[0], payloads[0] + payloads[2])
    np.testing.assert_array_equal(outs[2], outs[0])
    np.testing.assert_array_equal(outs[1], payloads[1])
    iterations = {s.snapshot().iterations for s in stages}
    assert iterations == {-(-40 // 7)}  # (16 - 1) // 2 elements per slot: the larger payload's count
    after = together(*(lambda s=s: s.reduce(np.ones(3, np.float32)) for s in stages))  # still aligned
    assert all(np.array_equal(a, np.full(3, 3.0)) for a in after)
