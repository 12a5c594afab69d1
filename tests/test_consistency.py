"""Topology consistency (paper §VII-A): one policy version per iteration, for every node."""

from __future__ import annotations

import random

import pytest

from netstorm import scenario
from netstorm.planning.plan import plan
from netstorm.policy import Policy
from scheduler.consistency import Consistency, ConsistencyError

RATES = scenario.load("internet2-9").rates()


def policies(count: int) -> list[Policy]:
    """Distinct policies: the same overlay with one link's rate changed a little more each time."""
    out = []
    for i in range(count):
        rates = dict(RATES)
        rates[(8, 7)] = 5.0 + 40.0 * i
        out.append(plan(rates, num_roots=3).with_version(i))
    return out


P0, P1, P2 = policies(3)


def test_first_request_binds_the_iteration_for_every_node() -> None:
    c = Consistency()
    c.publish(P0)
    first = c.request(iteration=0, known_version=-1)
    assert (first.version, first.newly_bound) == (0, True)
    assert first.policy == P0.to_wire()
    assert Policy.from_wire(first.policy) == P0
    c.publish(P1)  # a newer policy must not change an iteration that is already bound
    for _node in range(4):
        later = c.request(iteration=0, known_version=-1)
        assert (later.version, later.newly_bound) == (0, False)
        assert later.policy == P0.to_wire()


def test_node_that_holds_the_bound_version_gets_unchanged() -> None:
    c = Consistency()
    c.publish(P0)
    assert c.request(0, known_version=-1).policy is not None
    assert c.request(0, known_version=0).policy is None
    assert c.request(1, known_version=0).policy is None
    c.publish(P1)
    answer = c.request(2, known_version=0)
    assert (answer.version, answer.policy) == (1, P1.to_wire())
    assert c.request(1, known_version=1).policy == P0.to_wire()  # held version differs from the bound one


def test_new_policy_applies_to_iterations_not_yet_bound_and_prefetch_is_allowed() -> None:
    c = Consistency()
    c.publish(P0)
    c.request(5, known_version=-1)   # iteration 5 runs
    c.request(6, known_version=0)    # a node asks for 6 while 5 runs: bound to the current version
    c.publish(P1)
    assert c.request(6, known_version=0).version == 0
    assert c.request(7, known_version=0).version == 1
    assert c.bindings == {5: 0, 6: 0, 7: 1}


def test_no_policy_yet_and_stale_versions_are_refused() -> None:
    c = Consistency()
    with pytest.raises(ConsistencyError, match="no policy has been planned yet for iteration 0"):
        c.request(0, known_version=-1)
    with pytest.raises(ConsistencyError, match="iteration must be >= 0"):
        c.request(-1, known_version=-1)
    c.publish(P1)
    with pytest.raises(ConsistencyError, match="version 0 is not newer than the current 1"):
        c.publish(P0)
    assert c.current_version == 1


def test_memory_is_bounded_and_forgotten_iterations_are_refused_not_rebound() -> None:
    c = Consistency(window=3)
    c.publish(P0)
    c.request(0, -1)
    c.publish(P1)
    for k in (1, 2, 3):
        c.request(k, -1)
    assert sorted(c.bindings) == [1, 2, 3]
    with pytest.raises(ConsistencyError, match="iteration 0 is too old"):
        c.request(0, -1)
    c.publish(P2)
    c.request(4, -1)
    c.request(5, -1)
    c.request(6, -1)
    with pytest.raises(KeyError):
        c.policy(0)  # no remembered iteration uses version 0 any more
    with pytest.raises(KeyError):
        c.policy(1)
    assert c.policy(2) == P2


def test_random_interleavings_give_every_node_one_version_per_iteration() -> None:
    """Five nodes, each asking for k and prefetching k+1, publishes at random moments; brute-force check."""
    rng = random.Random(7)
    versions = policies(6)
    for trial in range(50):
        c = Consistency()
        published = 0
        c.publish(versions[0])
        held = dict.fromkeys(range(5), -1)
        next_iter = dict.fromkeys(range(5), 0)
        seen: dict[int, set[int]] = {}
        while min(next_iter.values()) < 12:
            if rng.random() < 0.1 and published + 1 < len(versions):
                published += 1
                c.publish(versions[published])
            node = rng.randrange(5)
            k = next_iter[node]
            if k >= 12:
                continue
            for iteration in (k, k + 1):  # the request for k and the prefetch of k+1
                answer = c.request(iteration, held[node])
                if answer.policy is None:
                    assert answer.version == held[node]
                else:
                    assert Policy.from_wire(answer.policy).version == answer.version
                seen.setdefault(iteration, set()).add(answer.version)
            held[node] = max(held[node], c.bindings[k + 1], c.bindings[k])
            next_iter[node] = k + 1
        assert all(len(v) == 1 for v in seen.values()), (trial, seen)
        bound = [c.bindings[k] for k in sorted(c.bindings)]
        assert bound == sorted(bound), "versions never go backwards from one iteration to the next"
