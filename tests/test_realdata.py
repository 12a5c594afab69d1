"""DiLoCo's real data: the held-out parts are disjoint from the training data, every DC's batches come
from its own shard, and the models have the parameter counts the docs state."""

from __future__ import annotations

import numpy as np
import pytest

from netstorm.trainers.realdata import build, stdlib_corpus

pytestmark = pytest.mark.torch


def test_digits_shards_and_held_out_set() -> None:
    tasks = [build("digits", i, 3) for i in range(3)]
    assert tasks[0].parameters == 1_126_410
    batches = [t.batch(1) for t in tasks]
    assert all(x.shape == (64, 64) and y.shape == (64,) for x, y in batches)
    assert not np.array_equal(batches[0][0].numpy(), batches[1][0].numpy())  # each DC its own shard
    loss, accuracy = tasks[0].evaluate(tasks[0].model)
    assert loss > 2.0 and accuracy < 0.3  # an untrained model: chance level on the held-out fifth


def test_the_stdlib_corpus_holds_out_whole_files() -> None:
    train, held = stdlib_corpus()
    assert len(train) > 10_000_000 and len(held) > 1_000_000
    assert b"def " in held and held not in train
    task = build("pylm", 0, 2, batch=4)
    assert task.parameters == 1_445_824
    x, y = task.batch(3)
    assert x.shape == y.shape == (4, 64) and bool((x[:, 1:] == y[:, :-1]).all())
