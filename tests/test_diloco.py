"""DiLoCo's schedule, outer step, digests, compression and elasticity, on an in-process job
(tests/diloco_job.py): every DC's trainer in a thread, the sums taken in DC order, so the runs must equal
the single-process reference (``netstorm.diloco.reference``) bit for bit."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import numpy as np
import pytest

from netstorm.diloco import state as st
from netstorm.diloco.codec import OuterCompression
from netstorm.diloco.core import FragmentSync, GlobalState
from netstorm.diloco.outer import OuterSGD
from netstorm.diloco.reference import simulate
from netstorm.diloco.schedule import Schedule, fragment_bounds
from netstorm.diloco.sync import DiLoCo
from netstorm.errors import ConfigError, DigestMismatch
from tests.diloco_job import Job

SHAPES = {"w": (6, 7), "b": (9,)}
SIZE = 51
TARGETS = np.random.default_rng(7).normal(size=(4, SIZE)).astype(np.float32)


def initial(dc: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(dc)
    return {name: rng.normal(size=shape).astype(np.float32) for name, shape in SHAPES.items()}


def flat(params: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([v.reshape(-1) for v in params.values()])


def inner(dc: int, step: int, local: np.ndarray) -> None:
    """An SGD step on a noisy quadratic whose optimum differs per DC (the DCs' data differ)."""
    noise = np.random.default_rng([dc, step]).normal(scale=0.1, size=local.size).astype(np.float32)
    local -= np.float32(0.1) * (local - TARGETS[dc] + noise)


def run_dcs(job: Job, dcs: list[int], steps: int, **options: Any) -> dict[int, DiLoCo]:
    def one(dc: int) -> DiLoCo:
        dl = DiLoCo(job.client(dc), initial(dc), **options)
        for step in range(1, steps + 1):
            inner(dcs.index(dc), step, dl.local)
            dl.step()
        dl.close()
        return dl
    with concurrent.futures.ThreadPoolExecutor(len(dcs)) as pool:
        futures = {dc: pool.submit(one, dc) for dc in dcs}
        return {dc: f.result(timeout=60) for dc, f in futures.items()}


# ---- the schedule ------------------------------------------------------------------------------------

def test_fragments_are_sent_at_their_offsets_and_applied_tau_steps_later() -> None:
    s = Schedule(sync_every=8, fragments=4, delay=1)
    assert [s.offset(p) for p in range(4)] == [2, 4, 6, 8]
    sent = {t: s.sent_after(t) for t in range(1, 25) if s.sent_after(t) is not None}
    assert sent == {2: 0, 4: 1, 6: 2, 8: 3, 10: 0, 12: 1, 14: 2, 16: 3, 18: 0, 20: 1, 22: 2, 24: 3}
    applied = {t: s.applied_after(t) for t in range(1, 26) if s.applied_after(t) is not None}
    assert applied == {t + 1: s.sync_index(t) for t in sent}
    for index in range(12):  # every fragment once per H steps, in turn
        assert s.fragment_of(index) == index % 4 and s.sync_step(index) == 2 * (index + 1)
    blocking = Schedule(sync_every=5)  # DiLoCo: all of the model after every H steps, applied at once
    assert [t for t in range(1, 16) if blocking.sent_after(t) == 0] == [5, 10, 15]
    assert all(blocking.applied_after(t) == blocking.sync_index(t) for t in (5, 10, 15))
    for bad in ({"sync_every": 8, "fragments": 4, "delay": 2}, {"sync_every": 10, "fragments": 4}):
        with pytest.raises(ConfigError):
            Schedule(**bad)
    assert fragment_bounds(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    with pytest.raises(ConfigError):
        fragment_bounds(9, 4)  # would leave the last fragment empty


@pytest.mark.torch
def test_nesterov_outer_step_matches_torch_sgd() -> None:
    import torch

    rng = np.random.default_rng(1)
    theta = rng.normal(size=20).astype(np.float32)
    grads = rng.normal(size=(4, 20)).astype(np.float32)
    outer = OuterSGD()
    outer.bind(20)
    mine = theta.copy()
    ref = torch.nn.Parameter(torch.tensor(theta))
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    for g in grads:
        outer.step(mine, g[:12], 0, 12)
        outer.step(mine, g[12:], 12, 20)
        ref.grad = torch.tensor(g)
        opt.step()
    np.testing.assert_allclose(mine, ref.detach().numpy(), rtol=1e-6, atol=1e-6)


# ---- runs against the reference ----------------------------------------------------------------------

@pytest.mark.parametrize(("h", "p", "tau"), [(5, 1, 0), (8, 4, 1), (6, 2, 2)])
def test_a_run_equals_the_single_process_reference_bit_for_bit(h: int, p: int, tau: int) -> None:
    dcs = [1, 2, 3]
    steps = 4 * h + tau  # the last sync is applied: none is left in flight when the DCs stop
    runs = run_dcs(Job(dcs), dcs, steps, sync_every=h, fragments=p, fragment_delay=tau)
    want, locals_ = simulate(flat(initial(1)), 3, inner, steps, Schedule(h, p, tau))
    for i, dc in enumerate(dcs):
        np.testing.assert_array_equal(runs[dc].state.params, want.params)
        np.testing.assert_array_equal(runs[dc].state.outer.buffer, want.outer.buffer)
        np.testing.assert_array_equal(runs[dc].local, locals_[i])
        assert runs[dc].digest() == want.digest()
        assert len(runs[dc].records) == want.outer_steps
        assert all(r.contributors == (1, 2, 3) and r.weight == 3 for r in runs[dc].records)
    schedule = Schedule(h, p, tau)
    applied = [schedule.applied_after(t) for t in range(1, steps + 1)]
    assert want.outer_steps == len([a for a in applied if a is not None]) >= 4 * p  # each fragment every H steps


def test_a_digest_mismatch_is_a_typed_error() -> None:
    state = GlobalState(np.ones(10, np.float32), Schedule(4))
    mine = state.digest()
    other = GlobalState(np.ones(10, np.float32), Schedule(4))
    other.params[3] = np.nextafter(np.float32(1), np.float32(2))  # one ulp apart
    theirs = other.digest()
    assert mine != theirs
    total = st.meta(1, mine) + st.meta(1, theirs)
    with pytest.raises(DigestMismatch, match="sync 7"):
        st.check_meta(total, mine, 7, (1, 2))
    assert st.check_meta(st.meta(1, mine) + st.meta(0, mine), mine, 7, (1, 2)) == (1, 2)


@pytest.mark.parametrize("halves", [False, True])
def test_a_snapshot_carries_the_global_state_exactly(halves: bool) -> None:
    state = GlobalState(np.random.default_rng(0).normal(size=33).astype(np.float32), Schedule(6, 3, 1))
    state.params[5] = -0.0  # summed with zeros by the nodes it would come back +0.0: the state never holds it
    state.adopt(state.snapshot(0, 0))
    state.outer.buffer[:] = np.random.default_rng(1).normal(size=33).astype(np.float32)
    state.outer_steps = 17
    snapshot = state.snapshot(step=42, next_sync=20, in_sync=True, round_=1)
    encoded = snapshot.encode(halves)
    if halves:
        assert encoded.dtype == np.int32 and encoded.min() >= 0 and encoded.max() <= 0xFFFF
        carried = np.rint(encoded.astype(np.float32) + np.float32(0)).astype(np.int64)  # the node's int sum
    else:
        carried = encoded + np.zeros_like(encoded)  # the node's float32 sum with the other DCs' zeros
    back = state.decode_snapshot(carried)
    joiner = GlobalState(np.zeros(33, np.float32), Schedule(6, 3, 1))
    joiner.adopt(back)
    assert joiner.digest() == state.digest()
    assert (back.step, back.next_sync, back.in_sync, back.round) == (42, 20, True, 1)


def test_without_rejoin_every_dc_must_start_alike_and_sync_0_checks_it() -> None:
    dcs = [1, 2]
    job = Job(dcs)

    def one(dc: int, params: dict[str, np.ndarray]) -> DiLoCo:
        dl = DiLoCo(job.client(dc), params, sync_every=2, rejoin=False)
        for step in range(1, 5):
            inner(dc - 1, step, dl.local)
            dl.step()
        dl.close()
        return dl
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        same = [pool.submit(one, dc, initial(1)) for dc in dcs]
        runs = [f.result(timeout=30) for f in same]
    want, _ = simulate(flat(initial(1)), 2, inner, 4, Schedule(2))
    np.testing.assert_array_equal(runs[1].state.params, want.params)
    assert "netstorm.diloco.state" not in runs[0].state.zeros()
    job = Job(dcs)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        apart = [pool.submit(one, dc, initial(dc)) for dc in dcs]
        for f in apart:
            with pytest.raises(DigestMismatch, match="sync 0"):
                f.result(timeout=30)


# ---- elasticity ----------------------------------------------------------------------------------------

def test_a_dc_killed_mid_sync_leaves_a_round_of_survivors_whose_mean_is_over_them() -> None:
    dcs = [1, 2, 3]
    job = Job(dcs)
    h, steps, kill_at = 4, 20, 10  # DC 3 dies just before its sync after step 12
    absent_from = 2  # syncs 0, 1 (after steps 4, 8) have it; from sync 2 on it is gone

    def one(dc: int) -> DiLoCo:
        dl = DiLoCo(job.client(dc), initial(dc), sync_every=h)
        for step in range(1, steps + 1):
            inner(dcs.index(dc), step, dl.local)
            if dc == 3 and step == kill_at:
                job.kill(3)
                return dl
            dl.step()
        dl.close()
        return dl
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        runs = {dc: pool.submit(one, dc) for dc in dcs}
        results = {dc: f.result(timeout=60) for dc, f in runs.items()}
    want, _ = simulate(flat(initial(1)), 3, inner, steps, Schedule(h),
                       absent=lambda dc, sync: dc == 2 and sync >= absent_from)
    for dc in (1, 2):
        np.testing.assert_array_equal(results[dc].state.params, want.params)
        assert [r.contributors for r in results[dc].records] == [(1, 2, 3)] * 2 + [(1, 2)] * 3
        assert [r.weight for r in results[dc].records] == [3, 3, 2, 2, 2]


def test_a_dc_killed_during_a_sync_in_flight_is_retried_without_it() -> None:
    job = Job([1, 2, 3])

    def fault(iteration: int, dc: int) -> None:  # DC 3's push of sync 1 is in; it dies before the sums
        if iteration == 1 and dc == 3:
            job.kill_locked(3)
    job.after_push = fault

    def one(dc: int) -> DiLoCo:
        dl = DiLoCo(job.client(dc), initial(dc), sync_every=3)
        for step in range(1, 10):
            inner(dc - 1, step, dl.local)
            dl.step()
            if dc == 3 and step == 6:
                return dl  # its worker's sync failed with the DC
        dl.close()
        return dl
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = {dc: pool.submit(one, dc) for dc in (1, 2, 3)}
        runs = {dc: f.result(timeout=60) for dc, f in futures.items() if dc != 3}
    for dc in (1, 2):
        records = runs[dc].records
        assert [r.contributors for r in records] == [(1, 2, 3), (1, 2), (1, 2)]
        assert records[1].attempts == 2 and records[1].weight == 2
    assert runs[1].digest() == runs[2].digest()
    want, _ = simulate(flat(initial(1)), 3, inner, 9, Schedule(3), absent=lambda dc, sync: dc == 2 and sync >= 1)
    np.testing.assert_array_equal(runs[1].state.params, want.params)


def test_a_restarted_dc_rejoins_with_the_live_global_state_and_its_place_in_the_schedule() -> None:
    job = Job([1, 2])
    h, p, tau = 6, 3, 1
    joined = threading.Event()
    results: dict[int, DiLoCo] = {}

    def survivor(dc: int) -> None:
        dl = DiLoCo(job.client(dc), initial(dc), sync_every=h, fragments=p, fragment_delay=tau)
        for step in range(1, 31):
            inner(dc - 1, step, dl.local)
            dl.step()
            if step == 8 and dc == 1:
                joined.set()
        dl.close()
        results[dc] = dl

    def joiner() -> None:
        assert joined.wait(120)  # the deadlines here are for two busy cores: each wait ends on its event
        dl = DiLoCo(job.client(3), {k: np.zeros_like(v) for k, v in initial(3).items()},
                    sync_every=h, fragments=p, fragment_delay=tau)
        assert dl.joined_at is not None and dl.joined_at % (h // p) == 0
        while dl.steps < 30:
            inner(2, dl.steps + 1, dl.local)
            dl.step()
        dl.close()
        results[3] = dl
    threads = [threading.Thread(target=survivor, args=(1,)), threading.Thread(target=survivor, args=(2,)),
               threading.Thread(target=joiner)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert set(results) == {1, 2, 3}
    first = results[3].records[0]
    assert first.left_out and first.weight == 2  # the joiner's first sync: its weight is 0
    # it agreed on the digest at the first sync it took part in, and every DC ends bit-identical
    mine = {r.index: r.digest for r in results[3].records}
    assert all(r.digest == mine[r.index] for r in results[1].records if r.index in mine)
    assert results[1].digest() == results[2].digest() == results[3].digest()
    later = [r for r in results[1].records if r.index > first.index]
    assert later and all(r.weight == 3 and r.contributors == (1, 2, 3) for r in later)


def test_a_straggler_past_the_deadline_is_left_out_of_that_round_and_joins_the_next() -> None:
    job = Job([1, 2, 3])
    release = threading.Event()
    left_out = threading.Event()

    def one(dc: int) -> DiLoCo:
        dl = DiLoCo(job.client(dc), initial(dc), sync_every=4, straggler_s=0.2 if dc == 3 else None)
        for step in range(1, 13):
            if dc == 3 and step == 6:  # DC 3 is slow in the second round: past its deadline
                assert release.wait(20)
            inner(dc - 1, step, dl.local)
            rec = dl.step()
            if dc != 3 and rec is not None and rec.index == 1:
                left_out.set()
                release.set()
        dl.close()
        return dl
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = {dc: pool.submit(one, dc) for dc in (1, 2, 3)}
        runs = {dc: f.result(timeout=60) for dc, f in futures.items()}
    assert left_out.is_set()
    for dc in (1, 2, 3):
        assert [r.weight for r in runs[dc].records] == [3, 2, 3]
    assert [r.left_out for r in runs[3].records] == [False, True, False]
    assert runs[1].digest() == runs[2].digest() == runs[3].digest()
    want, _ = simulate(flat(initial(1)), 3, inner, 12, Schedule(4), absent=lambda dc, sync: dc == 2 and sync == 1)
    np.testing.assert_array_equal(runs[3].state.params, want.params)


# ---- outer compression -------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["fp16", "int8", "int4"])
def test_compressed_syncs_agree_at_every_dc_and_approach_the_exact_mean(method: str) -> None:
    dcs = [1, 2, 3]
    runs = run_dcs(Job(dcs), dcs, 24, sync_every=4, fragments=2, fragment_delay=1,
                   outer_compression=method, error_feedback=True)
    exact = run_dcs(Job(dcs), dcs, 24, sync_every=4, fragments=2, fragment_delay=1)
    assert runs[1].digest() == runs[2].digest() == runs[3].digest()
    err = np.abs(runs[1].state.params - exact[1].state.params).max()
    scale = np.abs(exact[1].state.params - flat(initial(1))).max()
    assert err < {"fp16": 0.01, "int8": 0.05, "int4": 0.3}[method] * scale


def test_error_feedback_keeps_what_a_quantized_round_did_not_send() -> None:
    state = GlobalState(np.zeros(40, np.float32), Schedule(2, 2), compression=OuterCompression("int4", True))
    delta = np.random.default_rng(3).normal(size=20).astype(np.float32)
    sync = FragmentSync(state, 0, delta, np.random.default_rng(0))
    peak_round = sync.tensors(0)
    sync.received(0, {k: v.astype(np.int64) for k, v in peak_round.items()}, (1,))
    values = sync.tensors(1)
    sync.received(1, {k: v.astype(np.int64) for k, v in values.items()}, (1,))
    assert sync.mean is not None
    np.testing.assert_allclose(sync.mean + state.residual[:20], delta, atol=1e-6)  # sent + kept = delta
    assert np.abs(values["netstorm.diloco.lanes"]).max() <= 7 and values["netstorm.diloco.lanes"].dtype == np.int8
    assert OuterCompression("int4").max_contributors() == 18 and OuterCompression("int8").lane == "int16"
