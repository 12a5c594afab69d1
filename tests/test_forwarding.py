"""The node's forwarding: links the policy asks to explore get a few chunks of every iteration."""

from __future__ import annotations

import dataclasses

from netstorm.config import Config
from netstorm.planning.plan import plan
from netstorm.policy import Policy
from node.forwarding import EXPLORE_CHUNKS, Forwarding
from tests.policy_graphs import internet2


def _asking(node: int) -> tuple[Policy, int, tuple[int, int]]:
    """A one-root plan, a tree edge of ``node`` and an idle link of ``node`` an auxiliary path of it
    starts with."""
    policy = plan(internet2(0.25), num_roots=1)
    idle = set(policy.rates) - policy.tree_links()
    for (src, dst), paths in sorted(policy.aux_paths.items()):
        if src != node or (src, dst) not in policy.tree_links():
            continue
        for path in paths[1:]:
            if (src, path[1]) in idle:
                return dataclasses.replace(policy, explore=frozenset({(src, path[1])})), dst, (src, path[1])
    raise AssertionError(f"node {node} has no tree edge with an auxiliary path over an idle link")


def _first_hops(forwarding: Forwarding, policy: Policy, dst: int, iteration: int, n: int) -> list[int]:
    hops = []
    for _ in range(n):
        path, scheduler = forwarding.choose(policy, dst, None, 1000, iteration)
        scheduler.done(path)
        hops.append(path[1])
    return hops


def test_each_iteration_sends_a_few_chunks_through_a_link_to_explore() -> None:
    node = 6
    policy, dst, link = _asking(node)
    forwarding = Forwarding(node, Config())
    first = _first_hops(forwarding, policy, dst, 3, 10)
    assert first == [link[1]] * EXPLORE_CHUNKS + [dst] * (10 - EXPLORE_CHUNKS)
    assert _first_hops(forwarding, policy, dst, 4, 10)[:EXPLORE_CHUNKS + 1] == [link[1]] * EXPLORE_CHUNKS + [dst]
    assert _first_hops(forwarding, policy, dst, 3, 3) == [dst] * 3, "a late chunk of an older iteration"
    assert forwarding.explored_chunks == 2 * EXPLORE_CHUNKS
    assert forwarding.aux_chunks == 2 * EXPLORE_CHUNKS


def test_nothing_is_explored_without_the_policy_asking_or_with_auxiliary_paths_off() -> None:
    node = 6
    policy, dst, _ = _asking(node)
    quiet = dataclasses.replace(policy, explore=frozenset())
    assert _first_hops(Forwarding(node, Config()), quiet, dst, 0, 5) == [dst] * 5
    off = Forwarding(node, Config(enable_aux_path=False))
    assert _first_hops(off, policy, dst, 0, 5) == [dst] * 5
    assert off.explored_chunks == 0


def test_beliefs_reach_older_versions_and_moves_the_version_they_amend() -> None:
    node = 6
    policy = plan(internet2(0.25), num_roots=1)
    edges = sorted((src, dst) for (src, dst), paths in policy.aux_paths.items()
                   if src == node and (src, dst) in policy.tree_links() and len(paths) > 1)
    assert len(edges) >= 2, edges
    (_, first), (_, second) = edges[:2]
    detour = policy.aux_paths[(node, first)][1]
    old, current = dataclasses.replace(policy, version=3), dataclasses.replace(policy, version=4)
    forwarding = Forwarding(node, Config())
    _, before = forwarding.choose(old, first, None, 1000, 0)
    _, same = forwarding.choose(current, first, None, 1000, 1)
    slow = {link: rate / 10 for link, rate in policy.rates.items()}  # every link ten times slower
    other = policy.aux_paths[(node, second)][1]
    amended = forwarding.believe(4, slow, amends=3,
                                 offload={(node, first): ((detour, 0.5),), (node, second): ((other, 0.25),)})
    assert amended == [before]
    assert before.offload == ((detour, 0.5),) and before.believed_bps
    assert not same.believed_bps and not same.offload, "version 4 was planned from these rates"
    _, later = forwarding.choose(old, second, None, 1000, 0)  # first chosen after the amendment
    assert later.offload == ((other, 0.25),) and later.believed_bps
    assert forwarding.believe(4, policy.rates) == [], "an older or repeated push changes nothing"
    assert before.offload == ((detour, 0.5),)
