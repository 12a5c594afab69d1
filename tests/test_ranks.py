"""The trainers (ranks) of one node, by plain calls on ``RankBook`` against node cores wired in memory.

Each rank's push counts and the node gets their sum once all have pushed; one rank more is refused; a
sum is released only after every rank read it; a push past ``max_ahead`` or holding NaN/Inf is refused
and changes no counter; a rank that leaves takes its unsummed values with it, and a replacement reads
nothing older than the node's next iteration.
"""

from __future__ import annotations

import numpy as np
import pytest

from netstorm.config import Config
from netstorm.errors import NonFinite, TooFarAhead, TrainerLimit
from netstorm.planning.plan import plan
from node.actions import Released
from node.ranks import RankBook
from tests.test_node_core import Mesh

CONFIG = Config(chunk_size=300, iteration_timeout=20.0)
POLICY = plan({(1, 2): 10.0, (2, 1): 10.0}, topology="fapt", version=0)


def mesh(config: Config = CONFIG) -> Mesh:
    return Mesh(config, lambda iteration: POLICY, ids=[1, 2])


def values(seed: int, job: Mesh) -> np.ndarray:
    return np.random.default_rng(seed).integers(-9, 9, job.layout.total).astype(np.float32)


def push(book: RankBook, rank: int, flat: np.ndarray, job: Mesh) -> list[int]:
    """A rank's push of every tensor, checked whole, then recorded."""
    keys = range(len(job.layout.tensors))
    per_key = {k: flat[job.layout.key_slice(k)] for k in keys}
    book.check_push(rank, job.layout, per_key)
    return [book.record(rank, k, per_key[k]) for k in keys]


def hand_over(book: RankBook, job: Mesh) -> list[int]:
    """What the shell does: every ready sum into node 1's core, oldest first; the iterations handed."""
    core = job.cores[1]
    handed = []
    for key in range(len(job.layout.tensors)):
        while (ready := book.ready(key)) is not None:
            iteration, total = ready
            assert core.open_contribution(key, iteration, job.now) == iteration
            job.take(1, core.policy_wanted(iteration))
            job.take(1, core.contribute(key, iteration, total, job.links(1), job.now))
            book.handed(key, iteration)
            handed.append(iteration)
    return handed


def read(book: RankBook, rank: int, job: Mesh) -> tuple[int, np.ndarray, list[tuple[int, int]]]:
    keys = list(range(len(job.layout.tensors)))
    iteration = book.pull_target(rank, job.layout, keys)
    assert job.cores[1].keys_ready(iteration, keys)
    result = job.cores[1].result(iteration).copy()
    releases = book.read(rank, iteration, keys)
    for done, key in releases:
        job.take(1, job.cores[1].pulled(done, key))
    return iteration, result, releases


def test_each_rank_counts_and_the_node_gets_their_sum_once_all_pushed() -> None:
    job = mesh()
    book = RankBook(1, job.cores[1], slots=2)
    a, b = book.join("rank a"), book.join("rank b")
    for rank in (a, b):
        book.start(rank, len(job.layout.tensors), replacement=False)
    with pytest.raises(TrainerLimit, match=r"trainers = 2"):
        book.join("rank c")
    va, vb, vc = values(1, job), values(2, job), values(3, job)
    push(book, a, va, job)
    assert hand_over(book, job) == []  # rank b has not pushed: nothing reaches the node
    assert job.cores[1].key_next(0) == 0
    push(book, b, vb, job)
    assert set(hand_over(book, job)) == {0}
    job.contribute(2, vc)
    job.run()
    iteration, result, releases = read(book, a, job)
    np.testing.assert_array_equal(result, va + vb + vc)
    assert iteration == 0 and releases == []  # rank b has not read it: the node keeps it
    _, result, releases = read(book, b, job)
    np.testing.assert_array_equal(result, va + vb + vc)
    assert len(releases) == len(job.layout.tensors)
    assert any(isinstance(e, Released) for e in job.events[1])


def test_a_push_past_the_window_or_with_nan_is_refused_and_changes_no_counter() -> None:
    job = mesh(CONFIG.replace(max_ahead=1, check_finite=True))
    book = RankBook(1, job.cores[1], slots=1)
    rank = book.join("trainer")
    book.start(rank, len(job.layout.tensors), replacement=False)
    assert push(book, rank, values(1, job), job)[0] == 0
    assert push(book, rank, values(2, job), job)[0] == 1  # one ahead of its oldest unpulled: allowed
    with pytest.raises(TooFarAhead, match=r"has not pulled iteration 0 \(max_ahead = 1\); pull first"):
        push(book, rank, values(3, job), job)
    assert book.push_iteration(rank, 0) == 2 and book.blocked(0, 2)
    hand_over(book, job)
    job.contribute(2, values(4, job))
    job.run()
    read(book, rank, job)
    bad = values(5, job)
    bad[3] = np.nan
    with pytest.raises(NonFinite, match=r"DC 1: tensor '\w+' holds NaN or Inf"):
        push(book, rank, bad, job)
    assert book.push_iteration(rank, 0) == 2 and not book.blocked(0, 2)
    assert push(book, rank, values(6, job), job)[0] == 2


def test_values_the_node_did_not_count_are_taken_back() -> None:
    job = mesh()
    book = RankBook(1, job.cores[1], slots=1)
    rank = book.join("trainer")
    book.start(rank, len(job.layout.tensors), replacement=False)
    iteration = book.record(rank, 0, values(1, job)[job.layout.key_slice(0)])
    assert book.push_iteration(rank, 0) == 1
    book.take_back(rank, 0, iteration)  # handing it to the node failed (say, no policy)
    assert book.push_iteration(rank, 0) == 0 and book.ready(0) is None


def test_a_rank_that_leaves_takes_its_values_and_a_replacement_reads_nothing_older() -> None:
    job = mesh()
    book = RankBook(1, job.cores[1], slots=2)
    a, b = book.join("rank a"), book.join("rank b")
    for rank in (a, b):
        book.start(rank, len(job.layout.tensors), replacement=False)
    book.initialized = True
    va, vb, vc, vd = (values(s, job) for s in range(4))
    push(book, a, va, job)
    assert book.leave(a, len(job.layout.tensors)) == []
    c = book.join("rank c")  # its slot is free again
    book.start(c, len(job.layout.tensors), replacement=True)
    push(book, b, vb, job)
    assert hand_over(book, job) == []  # rank a's values left with it: rank c's are missing
    push(book, c, vc, job)
    assert set(hand_over(book, job)) == {0}
    job.contribute(2, vd)
    job.run()
    for rank in (b, c):
        _, result, _ = read(book, rank, job)
        np.testing.assert_array_equal(result, vb + vc + vd)
    # Rank b pushes and leaves before reading; its replacement starts at the next iteration, and the
    # sum rank b left unread is released once complete, without anyone reading it.
    push(book, b, values(7, job), job)
    push(book, c, values(8, job), job)
    hand_over(book, job)
    book.leave(b, len(job.layout.tensors))
    d = book.join("rank d")
    book.start(d, len(job.layout.tensors), replacement=True)
    assert book.push_iteration(d, 0) == 2 and book.pull_iteration(d, 0) == 2
    job.contribute(2, values(9, job))
    job.run()
    _, result, releases = read(book, c, job)
    np.testing.assert_array_equal(result, values(7, job) + values(8, job) + values(9, job))
    assert len(releases) == len(job.layout.tensors) and book.unread(len(job.layout.tensors)) is None


def test_a_rank_that_had_not_pushed_into_a_failed_iteration_is_told_of_it_and_goes_on_past_it() -> None:
    """Iteration 0 fails at the node while rank b has pushed and rank a not yet (a peer died first): a's
    push is answered with that failure (``missed``), not counted into iteration 1 where it would wait
    with nothing said, and once told, both ranks' next pushes go to iteration 1 and sum there."""
    job = mesh()
    book = RankBook(1, job.cores[1], slots=2)
    a, b = book.join("rank a"), book.join("rank b")
    for rank in (a, b):
        book.start(rank, len(job.layout.tensors), replacement=False)
    keys = range(len(job.layout.tensors))
    push(book, b, values(2, job), job)
    assert book.missed(a, keys) is None  # nothing failed yet: a's push is iteration 0's
    job.take(1, job.cores[1].contribution_failed(0, "node 2's trainer died", job.now))
    assert job.cores[1].failure(0) is not None
    assert book.missed(b, keys) is None  # b pushed into it: its pull gets the failure, as before
    assert book.missed(a, keys) == 0
    book.pass_over(a, 0)
    assert book.missed(a, keys) is None
    book.pass_over(b, 0)  # b's pull of iteration 0 failed
    va, vb = values(3, job), values(4, job)
    assert set(push(book, a, va, job)) == set(push(book, b, vb, job)) == {1}
    assert set(hand_over(book, job)) == {1}
