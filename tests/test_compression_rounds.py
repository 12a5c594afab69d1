"""The compression round core (``session.Rounds``) by plain calls: several DCs' cores, each round's pushes
summed with numpy as the nodes would, every value checked against the primitives it is built from."""

from __future__ import annotations

import numpy as np
import pytest

from netstorm.compression import quantize, voting
from netstorm.compression.codecs import FediacCodec
from netstorm.compression.options import SCALE, VALUES, VOTES, CompressionOptions
from netstorm.compression.session import Done, Push, Rounds, Tensors

DCS = [1, 2, 3, 4, 5]
SHAPES = {"w": (40, 25), "b": (40,), "c": (3, 70)}
ELEMENTS = 40 * 25 + 40 + 3 * 70


def gradients(dc: int, step: int, scale: float = 1.0) -> Tensors:
    rng = np.random.default_rng([dc, step])
    return {name: (scale * rng.standard_normal(shape) * rng.exponential(1.0, shape)).astype(np.float32)
            for name, shape in SHAPES.items()}


def flat(tensors: Tensors) -> np.ndarray:
    return np.concatenate([np.asarray(tensors[name], dtype=np.float64).reshape(-1) for name in sorted(tensors)])


def cores(options: CompressionOptions, applied: int = 0, seed: int = 0) -> dict[int, Rounds]:
    model = gradients(0, 0)
    out = {dc: Rounds(options, model, seed) for dc in DCS}
    for dc, core in out.items():
        core.registered(model)
        core.start(len(DCS), dc, applied)
    return out


def summed(pushes: list[Tensors], applied: int = 0) -> Tensors:
    """What the nodes return: exact integer sums, float32 sums, the roots' threshold on the votes."""
    out: Tensors = {}
    for name in pushes[0]:
        values = [np.asarray(p[name]) for p in pushes]
        if values[0].dtype.kind in "iu":
            out[name] = np.asarray(np.sum(values, axis=0, dtype=np.int64))
        else:
            out[name] = np.asarray(np.sum(values, axis=0, dtype=np.float32))
        if name == VOTES and applied:
            out[name] = (out[name] >= applied).astype(np.int64)
    return out


def step(rounds: dict[int, Rounds], grads: dict[int, Tensors], applied: int = 0,
         ) -> tuple[dict[int, Tensors], list[dict[int, Tensors]], list[Tensors]]:
    """One iteration of every core: the results, every round's pushes and sums."""
    actions = {dc: core.begin(grads[dc]) for dc, core in rounds.items()}
    pushes: list[dict[int, Tensors]] = []
    sums: list[Tensors] = []
    while all(isinstance(a, Push) for a in actions.values()):
        round_pushes = {dc: a.tensors for dc, a in actions.items() if isinstance(a, Push)}
        total = summed(list(round_pushes.values()), applied)
        pushes.append(round_pushes)
        sums.append(total)
        actions = {dc: rounds[dc].received(total, seconds=0.5, wan_bytes=100) for dc in rounds}
    assert all(isinstance(a, Done) for a in actions.values()), "every DC ends in the same round"
    return {dc: a.tensors for dc, a in actions.items()}, pushes, sums


def sent_share(push: Tensors, total: Tensors, gia: np.ndarray, bits: int) -> np.ndarray:
    """What a DC's value push stands for, dense: its integers at the GIA over the global f."""
    f = quantize.scale(bits, len(DCS), quantize.global_peak(total[SCALE]))
    out = np.zeros(ELEMENTS)
    out[gia] = np.asarray(push[VALUES], dtype=np.float64)[:gia.size] / f
    return out


def test_vote_pushes_are_the_sampled_votes_and_counts_come_back_whole() -> None:
    options = CompressionOptions("fediac", k=0.05, bits=12, votes=2)
    rounds = cores(options)
    grads = {dc: gradients(dc, 1) for dc in DCS}
    _, pushes, sums = step(rounds, grads)
    k = options.k_of(ELEMENTS)
    for dc in DCS:
        rng = np.random.default_rng([0, dc])  # the core's: seed, node id
        expected = voting.sample_votes(flat(grads[dc]), k, rng)
        vote = pushes[0][dc][VOTES]
        assert vote.dtype == np.uint8 and np.array_equal(vote, expected)
        assert 0 < int(vote.sum()) <= k
        assert not pushes[0][dc][VALUES].any()  # the vote round carries no values
    # the counts each core got are the exact sum of the votes, not a thresholded or capped one
    counts = np.sum([pushes[0][dc][VOTES].astype(np.int64) for dc in DCS], axis=0)
    assert np.array_equal(sums[0][VOTES], counts) and counts.max() > 1


def test_threshold_is_applied_to_the_full_count_only() -> None:
    """A core thresholds counts it is handed (or reads the roots' 0/1 GIA), never its own partial vote."""
    options = CompressionOptions("fediac", k=0.05, bits=12, votes=3)
    grads = {dc: gradients(dc, 1) for dc in DCS}
    plain, plain_pushes, plain_sums = step(cores(options), grads)
    rooted, rooted_pushes, rooted_sums = step(cores(options, applied=3), grads, applied=3)
    counts = plain_sums[0][VOTES]
    gia = voting.consensus(counts, 3)
    assert np.any(counts == 2) and np.any(counts >= 3)  # both sides of the threshold occur
    for dc in DCS:
        assert np.array_equal(plain_pushes[0][dc][VOTES], rooted_pushes[0][dc][VOTES])  # votes go up raw
        # the values sit at exactly the indices with >= a votes, whoever applied the threshold
        for pushes, total in ((plain_pushes, plain_sums), (rooted_pushes, rooted_sums)):
            values = pushes[1][dc][VALUES]
            assert not values[gia.size:].any()
            f = quantize.scale(12, len(DCS), quantize.global_peak(total[0][SCALE]))
            u = flat(grads[dc])[gia]
            assert np.all(np.abs(values[:gia.size] - f * u) < 1.0)  # theta(f U) at the GIA, in order
        for name in SHAPES:
            assert np.array_equal(plain[dc][name], rooted[dc][name])


def test_the_gia_and_the_decoded_sum_are_identical_at_every_dc() -> None:
    options = CompressionOptions("fediac", k=0.05, bits=10, votes=2)
    rounds = cores(options)
    for t in range(1, 4):
        results, pushes, sums = step(rounds, {dc: gradients(dc, t) for dc in DCS})
        assert len(pushes) == 2
        stats = [rounds[dc].last for dc in DCS]
        assert len({(s.gia, s.round_trips, s.bits) for s in stats}) == 1 and stats[0].gia > 0
        assert stats[0].round_s == (0.5, 0.5) and stats[0].wan_bytes == 200
        gia = voting.consensus(sums[0][VOTES], 2)
        assert stats[0].gia == gia.size
        for dc in DCS:
            for name in SHAPES:
                assert np.array_equal(results[dc][name], results[DCS[0]][name])
        # the decoded sum is the sum of what each DC sent, at the GIA only
        total = np.sum([sent_share(pushes[1][dc], sums[0], gia, 10) for dc in DCS], axis=0)
        np.testing.assert_allclose(flat(results[DCS[0]]), total, rtol=1e-6, atol=1e-6)
        assert not flat(results[DCS[0]])[np.setdiff1d(np.arange(ELEMENTS), gia)].any()


@pytest.mark.parametrize("method", ["fediac", "topk"])
def test_error_feedback_returns_exactly_what_was_not_sent(method: str) -> None:
    options = CompressionOptions(method, k=0.03, bits=8, votes=2)
    rounds = cores(options)
    carried = {dc: np.zeros(ELEMENTS) for dc in DCS}
    for t in range(1, 5):
        grads = {dc: gradients(dc, t) for dc in DCS}
        _, pushes, sums = step(rounds, grads)
        threshold = 2 if method == "fediac" else 1
        gia = voting.consensus(sums[0][VOTES], threshold)
        for dc in DCS:
            codec = rounds[dc].codec
            assert codec is not None
            wanted = flat(grads[dc]) + carried[dc]
            if method == "fediac":
                sent = sent_share(pushes[1][dc], sums[0], gia, 8)
            else:
                sent = np.zeros(ELEMENTS)
                sent[gia] = pushes[1][dc][VALUES][:gia.size]
            np.testing.assert_allclose(codec.residual + sent, wanted, rtol=0, atol=1e-12 * np.abs(wanted).max())
            outside = np.setdiff1d(np.arange(ELEMENTS), gia)
            assert np.array_equal(codec.residual[outside], wanted[outside])  # unsent coordinates kept whole
            carried[dc] = codec.residual.copy()


def test_gia_reuse_skips_the_vote_round_keeps_the_gia_and_error_feedback_exact() -> None:
    options = CompressionOptions("fediac", k=0.05, bits=12, votes=2, gia_reuse=3)
    rounds = cores(options)
    carried = {dc: np.zeros(ELEMENTS) for dc in DCS}
    gia = np.zeros(0, dtype=np.int64)
    peak = 0.0
    for t in range(1, 8):
        # iteration 5 grows 50x: the m agreed before it is too small, values are clipped, not overflowed
        grads = {dc: gradients(dc, t, 50.0 if t == 5 else 1.0) for dc in DCS}
        results, pushes, sums = step(rounds, grads)
        votes = t in (1, 4, 7)
        assert len(pushes) == (2 if votes else 1)
        stats = [rounds[dc].last for dc in DCS]
        assert all(s.reused is not votes and s.round_trips == len(pushes) for s in stats)
        if votes:
            gia = voting.consensus(sums[0][VOTES], 2)
            peak = quantize.global_peak(sums[0][SCALE])
        values = sums[-1]
        assert all(s.gia == gia.size for s in stats)
        f = quantize.scale(12, len(DCS), peak)
        limit = (2 ** 11 - len(DCS)) / len(DCS)
        clipped = False
        for dc in DCS:
            push = pushes[-1][dc]
            if not votes:
                assert not push[VOTES].any()  # no vote travels; this U's one-hot rides with the values
                assert np.array_equal(push[SCALE], quantize.scale_histogram(flat(grads[dc]) + carried[dc]))
            assert np.abs(push[VALUES]).max() <= limit + 1
            sent = np.zeros(ELEMENTS)
            sent[gia] = push[VALUES][:gia.size] / f
            wanted = flat(grads[dc]) + carried[dc]
            clipped |= bool(np.abs(f * wanted[gia]).max() > limit)
            residual = rounds[dc].codec.residual  # type: ignore[union-attr]
            np.testing.assert_allclose(residual + sent, wanted, rtol=0, atol=1e-12 * np.abs(wanted).max())
            assert np.array_equal(residual[np.setdiff1d(np.arange(ELEMENTS), gia)],
                                  wanted[np.setdiff1d(np.arange(ELEMENTS), gia)])
            carried[dc] = residual.copy()
            for name in SHAPES:
                assert np.array_equal(results[dc][name], results[DCS[0]][name])
        assert np.abs(values[VALUES]).max() <= 2 ** 11  # N clipped values cannot leave b bits
        # only the grown iteration outgrew the m it was scaled by; its excess stayed in the residual
        assert clipped == (t == 5)
        # the next reused iteration scales by the max of the U's just sent (after a vote: the vote's)
        peak = quantize.global_peak(sums[0][SCALE] if votes else values[SCALE])


def test_reuse_of_one_is_the_paper_every_iteration_votes() -> None:
    rounds = cores(CompressionOptions("fediac", k=0.05, bits=12, votes=2, gia_reuse=1))
    for t in range(1, 4):
        _, pushes, _ = step(rounds, {dc: gradients(dc, t) for dc in DCS})
        assert len(pushes) == 2 and not rounds[1].last.reused


def test_dense_first_round_derives_the_same_bits_everywhere_then_votes() -> None:
    rounds = cores(CompressionOptions("fediac", k=0.05, bits=0, votes=2))
    grads = {dc: gradients(dc, 1) for dc in DCS}
    results, pushes, _ = step(rounds, grads)
    assert len(pushes) == 1 and all(rounds[dc].last.dense for dc in DCS)
    expected = {name: np.sum([grads[dc][name] for dc in DCS], axis=0, dtype=np.float32) for name in SHAPES}
    for dc in DCS:
        for name in SHAPES:
            assert np.array_equal(results[dc][name], expected[name])
    assert len({rounds[dc].bits for dc in DCS}) == 1 and rounds[1].bits >= 4
    _, pushes, _ = step(rounds, {dc: gradients(dc, 2) for dc in DCS})
    assert len(pushes) == 2


def test_average_divides_by_the_contributors_and_dense_is_one_round() -> None:
    rounds = cores(CompressionOptions("none"))
    actions = {dc: core.begin(gradients(dc, 1), average=True) for dc, core in rounds.items()}
    total = summed([a.tensors for a in actions.values() if isinstance(a, Push)])
    for core in rounds.values():
        done = core.received(total)
        assert isinstance(done, Done)
        for name in SHAPES:
            assert np.array_equal(done.tensors[name], (total[name] / np.float32(len(DCS))).astype(np.float32))
        assert core.last.round_trips == 1


def test_begin_during_an_iteration_and_received_outside_one_are_refused() -> None:
    core = cores(CompressionOptions("fediac", k=0.05, bits=12, votes=2))[1]
    with pytest.raises(RuntimeError):
        core.received({})
    core.begin(gradients(1, 1))
    with pytest.raises(RuntimeError):
        core.begin(gradients(1, 2))


@pytest.mark.parametrize(("options", "fail_in"), [
    (CompressionOptions("fediac", k=0.05, bits=12, votes=2), 0),
    (CompressionOptions("fediac", k=0.05, bits=12, votes=2), 1),
    (CompressionOptions("fediac", k=0.05, bits=12, votes=2, gia_reuse=2), 0),
    (CompressionOptions("topk", k=0.05), 1),
    (CompressionOptions("fediac", k=0.05, bits=0, votes=2), 0),
])
def test_a_failed_iteration_is_undone_and_the_next_is_what_a_run_without_it_makes(
        options: CompressionOptions, fail_in: int) -> None:
    """A round's sums never come (its push raised at every DC): ``abort`` puts each core back as it was
    before ``begin`` (residual, kept GIA, random draws), so later iterations decode exactly what a run
    that never had the failed one decodes, and the residual is still exactly what was not sent."""
    failing, clean = cores(options), cores(options)
    # a history first (residuals, a kept GIA); with b derived none, so the dense round is the one to fail
    for t in () if options.bits == 0 else (1, 2):
        step(failing, {dc: gradients(dc, t) for dc in DCS})
        step(clean, {dc: gradients(dc, t) for dc in DCS})
    before = {dc: core.codec.residual.copy() for dc, core in failing.items() if core.codec is not None}
    # the failed iteration: its first round (or its values round) never gets its sums
    actions = {dc: core.begin(gradients(dc, 99)) for dc, core in failing.items()}
    if fail_in:
        total = summed([a.tensors for a in actions.values() if isinstance(a, Push)])
        actions = {dc: failing[dc].received(total) for dc in DCS}
        assert all(isinstance(a, Push) for a in actions.values())
    for core in failing.values():
        core.abort()
        core.abort()   # a second abort (the shell's, after the core's own) changes nothing
    for dc, residual in before.items():
        codec = failing[dc].codec
        assert codec is not None and np.array_equal(codec.residual, residual)
    for t in (3, 4):
        got, _, _ = step(failing, {dc: gradients(dc, t) for dc in DCS})
        want, _, _ = step(clean, {dc: gradients(dc, t) for dc in DCS})
        for dc in DCS:
            for name in SHAPES:
                assert np.array_equal(got[dc][name], want[dc][name]), (dc, name, t)
            a, b = failing[dc].codec, clean[dc].codec
            assert a is not None and b is not None and np.array_equal(a.residual, b.residual)
            assert failing[dc].bits == clean[dc].bits


def test_the_shells_abort_the_rounds_when_a_push_fails() -> None:
    from netstorm.compression.session import CompressedClient
    from netstorm.errors import TrainerTimeout

    class Failing:
        num_workers, node_id = len(DCS), 1

        def init(self, tensors: Tensors, **_: object) -> Tensors:
            return dict(tensors)

        def push_pull(self, tensors: Tensors, average: bool = False) -> Tensors:
            raise TrainerTimeout("iteration 7 timed out")

    client = CompressedClient(Failing(), CompressionOptions("fediac", k=0.05, bits=12, votes=2))
    client.init(gradients(0, 0))
    for _ in range(2):   # without the abort, the second begin would be refused mid-iteration
        with pytest.raises(TrainerTimeout):
            client.push_pull(gradients(1, 1))
    assert client.rounds is not None and client.rounds._phase == "idle"


def test_abort_also_undoes_a_round_whose_sums_could_not_be_decoded() -> None:
    """A ``received`` that raises midway (here a reused round's sums without their values: it has
    already taken the new m from the scale) leaves the iteration to ``abort``, which restores the state
    as before ``begin``; a done iteration leaves nothing for a later ``abort`` to undo."""
    options = CompressionOptions("fediac", k=0.05, bits=12, votes=2, gia_reuse=3)
    rounds = cores(options)
    step(rounds, {dc: gradients(dc, 1) for dc in DCS})
    core = rounds[DCS[0]]
    codec = core.codec
    assert isinstance(codec, FediacCodec)
    before = (codec.residual.copy(), codec.state.served, codec.state.peak, repr(codec.rng.bit_generator.state))
    push = core.begin(gradients(DCS[0], 2))
    assert isinstance(push, Push) and core.last.reused
    with pytest.raises(KeyError):
        core.received({SCALE: np.eye(quantize.SCALE_BUCKETS, dtype=np.int64)[3] * len(DCS)})
    assert codec.state.peak != before[2]
    core.abort()
    after = (codec.residual, codec.state.served, codec.state.peak, repr(codec.rng.bit_generator.state))
    assert np.array_equal(after[0], before[0]) and after[1:] == before[1:]
    # a done iteration is kept: abort between iterations changes nothing
    step(rounds, {dc: gradients(dc, 2) for dc in DCS})
    kept = (codec.residual.copy(), codec.state.served, codec.state.peak)
    core.abort()
    assert np.array_equal(codec.residual, kept[0]) and (codec.state.served, codec.state.peak) == kept[1:]
