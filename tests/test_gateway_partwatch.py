"""The part watch's rule, by plain calls: LAN chunks that complete make the parts over them ready (a part
once), the tensors whose waiters wake are those that got one, each part is taken once in completion order,
and what is handed is the LAN sum there plus the trainer's own values."""

from __future__ import annotations

import numpy as np

from bpf.partwatch import PartWatch
from netstorm.lan.layout import EdgeLayout
from netstorm.lan.sums import IterationSums

LANES = 100


def _sums() -> IterationSums:
    """Tensor 0: 250 elements in LAN chunks 0..2; tensor 1: 450 in chunks 3..7; every lane holds its element
    index in the tensor (scale 0: exact), so a part's sum names its elements."""
    layout = EdgeLayout.uniform([250, 450], scale=0, lanes=LANES, pool=64)
    sums = IterationSums(layout, 2, 1, 3)
    for tensor, size in enumerate(layout.sizes):
        for chunk in range(layout.chunks[tensor]):
            row = layout.seq(tensor, chunk)
            lanes = np.arange(chunk * LANES, min(size, (chunk + 1) * LANES))
            sums.raw[row, : lanes.size] = lanes
            sums.scales[row] = 0
    return sums


def _complete(sums: IterationSums, watch: PartWatch, *seqs: int) -> set[int]:
    sums.open[list(seqs)] = False
    return watch.completed(np.array(seqs, np.int64))


def test_completed_chunks_wake_the_tensors_that_got_a_part_ready_and_each_part_is_taken_once() -> None:
    sums = _sums()
    watch = PartWatch(sums)
    parts = [(0, 150), (150, 300), (300, 450)]
    watch.follow(1, parts)
    assert not watch.ready(1) and watch.next_part(1) is None
    assert _complete(sums, watch, 3) == set()              # part 0 still needs chunk 4 (it straddles 0 and 1)
    assert _complete(sums, watch, 0, 1, 2) == set()        # tensor 0 is not followed: nobody to wake
    assert _complete(sums, watch, 4) == {1}
    assert _complete(sums, watch, 7, 6) == {1}             # part 2 ready before part 1
    assert _complete(sums, watch, 5) == {1}
    assert watch.ready(1)
    assert [watch.next_part(1), watch.next_part(1), watch.next_part(1)] == [0, 2, 1]   # completion order
    assert watch.next_part(1) is None and not watch.ready(1)
    assert _complete(sums, watch, 4) == set()              # completed twice: no part is ready twice


def test_a_tensor_followed_late_has_its_complete_parts_ready_at_once() -> None:
    sums = _sums()
    sums.open[[0, 1]] = False                              # summed before the watch began
    watch = PartWatch(sums)
    watch.follow(0, [(0, 200), (200, 250)])
    assert watch.next_part(0) == 0 and watch.next_part(0) is None
    assert _complete(sums, watch, 2) == {0} and watch.next_part(0) == 1


def test_what_is_handed_is_the_lan_sum_plus_the_trainers_own_values_and_the_first_hand_out_is_timed() -> None:
    sums = _sums()
    sums.open[:] = False
    watch = PartWatch(sums)
    np.testing.assert_array_equal(watch.summed(1, 150, 300, None), np.arange(150, 300, dtype=np.float32))
    own = np.full(450, 0.5, np.float32)
    np.testing.assert_array_equal(watch.summed(1, 150, 300, own), np.arange(150, 300, dtype=np.float32) + 0.5)
    assert watch.first_handed is None and watch.handed == 0
    watch.handed_one(7.0)
    watch.handed_one(9.0)
    assert watch.first_handed == 7.0 and watch.handed == 2
