"""A DC restarted into a running job, at the stage and protocol level: ranks are threads, the nodes one
in-process sum per iteration over the DCs that are members then (what the runtime guarantees: every
member's rank pushes into every iteration, and the sum names its contributors)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from netstorm.torch import rejoin
from netstorm.torch.jobranks import agree
from netstorm.torch.stage import ROUND_NAME, Stage

pytestmark = pytest.mark.torch

ROUND = 64


class Job:
    """The nodes: iteration k sums the pushes of the DCs that are members from k on."""

    def __init__(self, dcs: list[int]) -> None:
        self.cond = threading.Condition()
        self.slots: dict[int, dict[int, dict[str, np.ndarray]]] = {}
        self.next: dict[int, int] = dict.fromkeys(dcs, 0)
        self.members: list[tuple[int, tuple[int, ...]]] = [(0, tuple(dcs))]
        self.providers: dict[int, Callable[[], Mapping[str, np.ndarray]]] = {}

    def members_at(self, k: int) -> tuple[int, ...]:
        return [m for start, m in self.members if start <= k][-1]

    def change(self, dcs: list[int]) -> int:
        """From the next iteration on, ``dcs`` are the members; that iteration."""
        with self.cond:
            current = self.members[-1][1]
            k = max(self.next[d] for d in current)
            self.members.append((k, tuple(dcs)))
            for dc in set(dcs) - set(current):  # a DC (re)joining starts at that iteration
                self.next[dc] = k
            return k

    def step(self, dc: int, tensors: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], tuple[int, ...], int]:
        with self.cond:
            k = self.next[dc]
            self.next[dc] = k + 1
            slot = self.slots.setdefault(k, {})
            slot[dc] = {name: np.array(value, copy=True) for name, value in tensors.items()}
            members = self.members_at(k)
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: all(d in slot for d in members), timeout=20), (k, members, slot.keys())
            return {name: np.sum([slot[d][name] for d in members], axis=0) for name in tensors}, members, k


class Client:
    """One rank's node client over ``Job`` (one rank per DC)."""

    def __init__(self, job: Job, dc: int, provider: int | None = None) -> None:
        self.job, self.node_id, self.provider = job, dc, provider
        self.num_workers = len(job.members_at(job.next[dc]))
        self.contributors: tuple[int, ...] = ()
        self.iteration = -1

    def init(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.provider is None:  # a new job: every rank registers zeros
            return {name: np.zeros_like(value) for name, value in tensors.items()}
        return dict(self.job.providers[self.provider]())  # the hand-over of a live rank

    def set_model_provider(self, provider: Callable[[], Mapping[str, np.ndarray]]) -> None:
        self.job.providers[self.node_id] = provider

    def push_pull(self, tensors: dict[str, np.ndarray], average: bool = False) -> dict[str, np.ndarray]:
        assert not average  # the stage takes its means itself
        out, members, self.iteration = self.job.step(self.node_id, tensors)
        self.num_workers, self.contributors = len(members), members
        return out

    def close(self) -> None:
        pass


def together(*calls: Callable[[], Any]) -> list[Any]:
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result(timeout=30) for f in [pool.submit(c) for c in calls]]


def test_a_restarted_dc_waits_out_the_survivors_step_then_takes_their_state_and_its_old_rank() -> None:
    job = Job([1, 2, 3])
    stages = {dc: Stage(Client(job, dc), ROUND, on_dc_loss="continue") for dc in (1, 2, 3)}
    assert not any(s.rejoining for s in stages.values())  # a new job's init holds zeros
    ranks = together(*(lambda dc=dc: agree(stages[dc], dc - 1, 3) for dc in (1, 2, 3)))
    # DC 3 is lost: the survivors' sums count two
    job.change([1, 2])
    survivors = {dc: stages[dc] for dc in (1, 2)}
    out = together(*(lambda s=s: s.reduce(np.full(5, 3.0, np.float32), average=True) for s in survivors.values()))
    assert all(np.array_equal(o, np.full(5, 3.0)) for o in out) and stages[1].workers == 2
    # DC 3 comes back: its init gets DC 1's hand-over, its rank pushes zeros into the survivors' step
    job.change([1, 2, 3])
    joiner = Stage(Client(job, 3, provider=1), ROUND, on_dc_loss="continue")
    assert joiner.rejoining
    state = bytes(range(256)) * 3 + b"odd"
    joined: list[rejoin.Joined] = []

    def join() -> None:
        joined.append(rejoin.join(joiner, 2, 3, timeout=20))

    thread = threading.Thread(target=join)
    thread.start()
    grads = {1: np.arange(ROUND + 7, dtype=np.float32), 2: np.full(ROUND + 7, 2.0, np.float32)}
    means = together(*(lambda dc=dc: survivors[dc].reduce(grads[dc], average=True) for dc in (1, 2)))
    for mean in means:  # two pieces, each the survivors' mean: the joiner's zeros are not counted
        np.testing.assert_array_equal(mean, (grads[1] + grads[2]) / np.float32(2))
    assert survivors[1].join_pending == (3,) and survivors[1].workers == 2
    sources = together(*(lambda dc=dc: rejoin.survive(survivors[dc], dc - 1, 3, ranks[dc - 1], state, 17)
                         for dc in (1, 2)))
    thread.join(timeout=30)
    assert sources == [0, 0] and joined, "the joiner took no state"
    assert joined[0] == rejoin.Joined(ranks[2], 17, state, 0)
    # from here every sum holds and counts all three
    stages[3] = joiner
    total = together(*(lambda s=s: s.reduce(np.ones(3, np.float32), average=True) for s in stages.values()))
    assert all(np.array_equal(t, np.ones(3)) for t in total) and stages[1].workers == 3
    assert stages[1].join_pending == ()


def test_the_announcement_carries_length_and_step_and_refuses_survivors_that_disagree() -> None:
    a = rejoin.announcement(1, 3, 2**33 + 5, 70_000)
    assert rejoin.read_announcement(a, 3) == (1, 2**33 + 5, 70_000)
    both = a + rejoin.announcement(2, 3, 2**33 + 5, 70_000)
    assert rejoin.read_announcement(both, 3) == (1, 2**33 + 5, 70_000)
    with pytest.raises(rejoin.RejoinError, match="different states"):
        rejoin.read_announcement(a + rejoin.announcement(0, 3, 9, 70_000), 3)
    with pytest.raises(rejoin.RejoinError, match="exceeds"):
        rejoin.read_announcement(rejoin.announcement(0, 1, rejoin.MAX_STATE_BYTES + 1, 0), 1)


def test_the_hand_over_a_live_rank_offers_is_zeros_with_the_control_word() -> None:
    job = Job([1])
    stage = Stage(Client(job, 1), 8, on_dc_loss="continue")
    offered = job.providers[1]()
    assert set(offered) == {ROUND_NAME} and offered[ROUND_NAME].size == 9
    assert offered[ROUND_NAME][8] == 1.0 and not offered[ROUND_NAME][:8].any()
    assert stage.may_rejoin and not Stage(Client(job, 1), 8).may_rejoin  # rejoining needs on_dc_loss continue
