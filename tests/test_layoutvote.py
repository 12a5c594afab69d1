"""The job's layout is the scheduler's configured one, or what a majority of its DCs registered, never what
the first trainer did; the configured hash, from a model's name or arrays, is the one nodes compute."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from netstorm import models
from netstorm.errors import ConfigError
from netstorm.joblayout import job_layout, model_specs
from netstorm.layout import Layout, TensorSpec
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


def test_a_configured_layout_decides_every_check_at_once_even_the_first_of_two_dcs():
    vote = LayoutVote([1, 2], configured="right")
    assert vote.adopted == ("right", 0)
    wrong = vote.check(1, "wrong")  # first, and with two DCs a majority would need both
    assert "node 1 has layout wrong but the job's layout is right (the scheduler's layout_hash)" in wrong.mismatch
    assert vote.check(2, "right").agreed
    assert vote.check(1, "right").agreed  # DC 1's replacement
    assert vote.check(2, "wrong").mismatch  # no vote moves it: two wrong DCs are refused alike
    assert vote.check(1, "wrong").mismatch and vote.adopted == ("right", 0)


def test_a_configured_layout_agrees_with_a_restored_one_or_the_scheduler_does_not_start():
    assert LayoutVote([1, 2, 3], adopted=("x", 2), configured="x").check(1, "x").agreed
    with pytest.raises(ValueError, match="layout_hash is y"):
        LayoutVote([1, 2, 3], adopted=("x", 2), configured="y")


def test_the_hash_of_a_model_file_or_name_is_the_one_a_node_computes_for_its_trainer(tmp_path: Path) -> None:
    arrays: dict[str, Any] = {"fc.weight": np.zeros((30, 20), np.float32), "fc.bias": np.zeros(30, np.float32),
              "steps": np.zeros(3, np.int32)}
    np.savez(tmp_path / "m.npz", **arrays)
    trainer = [TensorSpec.of(name, array) for name, array in arrays.items()]
    for compression in ("none", "fp16"):
        want = job_layout(trainer, 100, compression, "none").hash
        assert job_layout(model_specs(str(tmp_path / "m.npz")), 100, compression, "none").hash == want
    assert job_layout(trainer, 100).hash != job_layout(trainer, 200).hash  # the job's chunk_size counts
    assert job_layout(model_specs("1e3/4"), 100).hash == Layout.build(
        [TensorSpec(n, s, "float32") for n, s in models.layout("1e3/4").tensors], 100).hash
    with pytest.raises(ConfigError, match="unknown model"):
        model_specs("nonsense")
