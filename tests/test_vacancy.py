"""A DC whose trainer place is empty after the init round, by plain calls on node cores wired in memory,
with the scheduler's relay of the control messages played by ``Relay``: its next iteration fails at every
member as soon as it is under way anywhere, at the same (fake) instant, whether the DC is a leaf of every
tree (a member asks for its part) or a root (a peer's chunk reaches it), or was in the middle of a push;
the one after waits for a replacement, which makes it exact, and a stale ask after it changes nothing.
"""

from __future__ import annotations

import numpy as np

from netstorm.planning.plan import plan
from node.actions import Action, AskPart, Cause, IterationFailed, ReportLost, ReportVacancy
from node.ranks import RankBook
from tests.test_node_core import CONFIG, MESH, STAR, Mesh

NODES = MESH
"""Node 4 is the star's root; 1, 2 and 3 are leaves, which nothing reaches before their own part is in."""


class Relay(Mesh):
    """The mesh, with the control plane's messages carried at once: a lost iteration and an empty place to
    every other member, an ask to the member asked (``tell=False`` leaves the vacancies untold)."""

    tell = True

    def take(self, node: int, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, ReportLost):
                self.events[node].append(action)
                for other in self.cores:
                    if other != node:
                        super().take(other, self.cores[other].iteration_lost(
                            action.iteration, f"node {node}: {action.reason}", self.now))
            elif isinstance(action, ReportVacancy):
                self.events[node].append(action)
                for other in self.cores if self.tell else ():
                    if other != node:
                        self.take(other, self.cores[other].peer_vacancy(node, action.iteration, action.reason,
                                                                        action.filled, self.now))
            elif isinstance(action, AskPart):
                self.events[node].append(action)
                self.take(action.peer, self.cores[action.peer].part_wanted(node, action.iteration, self.now))
            else:
                super().take(node, [action])


def flat(seed: int, job: Mesh) -> np.ndarray:
    return np.random.default_rng(seed).integers(-9, 9, job.layout.total).astype(np.float32)


def exact_iteration(job: Relay, seed: int) -> int:
    """Every DC contributes, the frames are delivered, and each collects the exact sum."""
    values = {n: flat(seed + n, job) for n in job.cores}
    iterations = {job.contribute(n, values[n]) for n in job.cores}
    job.run()
    want = sum(values.values())
    for n in job.cores:
        assert np.array_equal(job.collect(n), want)
    [iteration] = iterations
    return iteration


def start(job: Relay, node: int, values: np.ndarray) -> int:
    """Node ``node``'s push of its next iteration, tensor by tensor, until it is in or the iteration failed
    (where the node's shell raises ``PeerLost`` to its trainer)."""
    core = job.cores[node]
    iteration = core.next_iteration()
    for key in range(len(job.layout.tensors)):
        core.open_contribution(key, iteration, job.now)
        job.take(node, core.policy_wanted(iteration))
        if core.failure(iteration) is not None:
            break
        job.take(node, core.contribute(key, iteration, values[job.layout.key_slice(key)], job.links(node), job.now))
        if core.failure(iteration) is not None:
            break
    return iteration


def failed(job: Relay, node: int, iteration: int) -> IterationFailed | None:
    return job.cores[node].failure(iteration)


def test_a_leaf_with_an_empty_place_fails_its_next_iteration_at_once_and_a_replacement_completes_the_one_after():
    job = Relay(CONFIG, lambda iteration: STAR, ids=NODES)
    assert exact_iteration(job, 10) == 0
    vacant = job.cores[1]
    job.take(1, vacant.vacate("node 1's trainer died", job.now))
    assert job.events[1][-1] == ReportVacancy(1, "node 1's trainer died")
    assert all(failed(job, n, 1) is None for n in NODES)  # nothing was under way: nothing fails yet
    job.now = 5.0
    # node 2 starts iteration 1: it asks node 1 for its part, which fails it everywhere at this instant
    start(job, 2, flat(1, job))
    assert AskPart(1, 1) in job.events[2]
    for n in NODES:
        failure = failed(job, n, 1)
        assert failure is not None and failure.cause is Cause.GONE, n
    assert "node 1's trainer died" in str(failed(job, 2, 1))
    assert [a.iteration for a in job.events[1] if isinstance(a, ReportLost)] == [1]
    job.run()  # the frames node 2 had queued for the failed iteration are ignored
    # no replacement yet: the next iteration waits (a retry failing at once would spend trainers' retries)
    third = flat(2, job)
    assert start(job, 3, third) == 2
    assert AskPart(1, 2) in job.events[3]
    assert all(failed(job, n, 2) is None for n in NODES)
    # a replacement inits: that iteration completes exactly everywhere
    job.take(1, vacant.fill())
    assert job.events[1][-1] == ReportVacancy(2, "", filled=True)
    values = {n: flat(20 + n, job) for n in (1, 2, 4)}
    assert {job.contribute(n, values[n]) for n in values} == {2}
    job.run()
    for n in NODES:
        assert np.array_equal(job.collect(n), sum(values.values()) + third)
    assert all(job.cores[n].vacancies.peers == {} for n in NODES)  # no member asks any more
    assert exact_iteration(job, 30) == 3


def test_a_root_with_an_empty_place_fails_the_iteration_when_a_peers_chunk_arrives():
    job = Relay(CONFIG, lambda iteration: STAR, ids=NODES)
    job.tell = False  # the members were not told: the chunks alone tell node 4 the iteration is under way
    exact_iteration(job, 30)
    job.take(4, job.cores[4].vacate("node 4's trainer closed", job.now))
    start(job, 2, flat(3, job))
    assert failed(job, 2, 1) is None  # its frames are still on the way
    job.run()
    assert all(getattr(failed(job, n, 1), "cause", None) is Cause.GONE for n in NODES)
    job.take(4, job.cores[4].fill())
    assert exact_iteration(job, 40) == 2


def test_a_trainer_gone_in_the_middle_of_a_push_fails_that_iteration_at_once():
    two = plan({(1, 2): 10.0, (2, 1): 10.0}, topology="fapt", version=0)
    job = Relay(CONFIG, lambda iteration: two, ids=[1, 2])
    exact_iteration(job, 50)
    core = job.cores[1]
    job.take(1, core.policy_wanted(core.open_contribution(0, None, job.now)))
    job.take(1, core.contribute(0, 1, flat(5, job)[job.layout.key_slice(0)], job.links(1), job.now))
    job.take(1, core.vacate("node 1's trainer died", job.now))  # one tensor of three was in
    assert [a.iteration for a in job.events[1] if isinstance(a, ReportLost)] == [1]
    assert job.events[1][-1] == ReportVacancy(2, "node 1's trainer died")
    assert failed(job, 1, 1) is not None and failed(job, 2, 1) is not None
    job.run()
    job.take(1, core.fill())
    assert exact_iteration(job, 60) == 2


def test_an_ask_that_crossed_the_replacements_init_changes_nothing():
    job = Relay(CONFIG, lambda iteration: STAR, ids=NODES)
    exact_iteration(job, 70)
    job.take(1, job.cores[1].vacate("gone", job.now))
    job.tell = False
    job.take(1, job.cores[1].fill())  # the members still hold node 1's place for empty
    assert exact_iteration(job, 80) == 1
    assert any(isinstance(a, AskPart) for a in job.events[2])  # node 2 asked, node 1 had its part already


def test_a_rank_book_is_vacant_only_after_the_init_round_and_until_a_replacement_joins():
    job = Mesh(CONFIG, lambda iteration: STAR, ids=NODES)
    book = RankBook(1, job.cores[1], slots=2)
    a = book.join("a")
    book.join("b")
    book.leave(a, len(job.layout.tensors))
    assert not book.vacant  # before the init round: the round itself waits for a second trainer
    book.initialized = True
    assert book.vacant
    book.join("a again")
    assert not book.vacant


def test_a_trainer_that_said_bye_leaves_the_next_iteration_waiting_for_the_next_jobs_trainer():
    """A clean close (``Bye``: a job ended) reports no empty place: a new job's trainer that inits at
    another DC first starts the next iteration, which waits for this DC's new trainer and is exact."""
    job = Relay(CONFIG, lambda iteration: STAR, ids=NODES)
    assert exact_iteration(job, 10) == 0
    job.take(1, job.cores[1].vacate("node 1's trainer closed", job.now, clean=True))
    assert not any(isinstance(a, ReportVacancy) for a in job.events[1])
    job.now = 5.0
    early = flat(2, job)
    assert start(job, 2, early) == 1   # another DC's new trainer first
    assert all(failed(job, n, 1) is None for n in NODES)
    assert not any(isinstance(a, AskPart) for a in job.events[2])
    values = {n: flat(20 + n, job) for n in (1, 3, 4)}   # node 1's new trainer, and the rest
    assert {job.contribute(n, values[n]) for n in values} == {1}
    job.run()
    for n in NODES:
        assert np.array_equal(job.collect(n), sum(values.values()) + early)
