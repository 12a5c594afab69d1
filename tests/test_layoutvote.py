"""The job's layout is what a majority of its DCs registered, never what the first trainer did."""

from __future__ import annotations

from scheduler.layoutvote import LayoutVote


def test_an_early_wrong_trainer_is_outvoted_and_refused_and_the_rest_agree():
    vote = LayoutVote([1, 2, 3])
    first = vote.check(1, "wrong")
    assert not first.agreed and not first.mismatch and (first.votes, first.needed) == (1, 2)
    assert vote.adopted is None
    assert not vote.check(2, "right").agreed  # one vote each: undecided
    assert vote.check(3, "right").agreed  # a majority: adopted
    assert vote.adopted == ("right", 2)
    assert vote.check(2, "right").agreed
    refused = vote.check(1, "wrong")
    assert "node 1 has layout wrong but the job's layout is right" in refused.mismatch
    assert vote.check(1, "right").agreed  # DC 1's replacement trainer with the right model


def test_a_dcs_newer_vote_replaces_its_older_one():
    vote = LayoutVote([1, 2, 3, 4, 5])
    for node in (1, 2):
        vote.check(node, "a")
    assert vote.check(1, "b").votes == 1  # node 1 changed its mind: a has one vote left
    assert vote.check(3, "a").votes == 2 and vote.adopted is None
    assert vote.check(4, "a").agreed and vote.adopted == ("a", 2)


def test_a_restored_layout_and_a_single_dc_need_no_vote():
    assert LayoutVote([1, 2, 3], adopted=("x", 2)).check(3, "x").agreed
    assert LayoutVote([1, 2, 3], adopted=("x", 2)).check(1, "y").mismatch
    assert LayoutVote([7]).check(7, "z").agreed
    assert LayoutVote([1, 2]).check(9, "z").votes == 0  # a stranger's vote never counts
