"""Scenarios without rates, and the bulk probe that measures them (``netstorm probe``, ``emulate --plan-scenario``)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from netstorm import bulkprobe
from netstorm.scenario import PRIOR_MBIT, load, parse, to_toml

DCS = {"name": "bare", "node": [{"id": 1, "address": "10.0.0.1"}, {"id": 2, "address": "10.0.0.2"},
                                {"id": 3, "address": "10.0.0.3"}]}


def assert_measures(ratios: list[float]) -> None:
    """Probed rates are the applied ones as a loaded host lets a TCP flow carry them: a busy 2-core host
    slows a probe (0.70-0.95 of the applied rate measured here with both cores busy), the shaper caps it,
    and nothing slows one link of a run far more than the others. A probe that measured the wrong link,
    the prior (500 Mbit/s) or a half-read window breaks one of these; host load alone does not."""
    assert ratios and all(0.5 <= r <= 1.1 for r in ratios), ratios
    assert max(ratios) / min(ratios) <= 1.5, ratios


def test_a_scenario_of_dcs_alone_is_a_full_mesh_at_the_prior() -> None:
    scenario = parse(DCS)
    assert sorted((lk.a, lk.b) for lk in scenario.links) == [(1, 2), (1, 3), (2, 3)]
    assert scenario.unknown == frozenset(scenario.rates())
    assert set(scenario.rates().values()) == {PRIOR_MBIT}
    assert scenario.node(2).address == "10.0.0.2"
    stated = parse({**DCS, "defaults": {"prior_mbit": 250}})
    assert set(stated.rates().values()) == {250.0}


def test_links_without_rates_keep_their_stated_neighbours_and_mix_with_stated_ones() -> None:
    scenario = parse({**DCS, "link": [{"a": 1, "b": 2, "rate_mbit": 40}, {"a": 2, "b": 3}]})
    assert scenario.unknown == {(2, 3), (3, 2)}
    assert scenario.rates()[(1, 2)] == 40.0 and scenario.rates()[(2, 3)] == PRIOR_MBIT
    assert (1, 3) not in scenario.rates()


def test_measured_rates_written_out_load_back_as_stated(tmp_path: Path) -> None:
    measured = {(1, 2): 41.5, (2, 1): 80.25, (1, 3): 30.0, (3, 1): 29.0, (2, 3): 60.0, (3, 2): 59.5}
    path = tmp_path / "measured.toml"
    path.write_text(to_toml(parse(DCS).with_rates(measured)))
    again = load(path)
    assert not again.unknown and again.rates() == measured
    assert [n.address for n in again.nodes] == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    half = parse(DCS).with_rates({(1, 2): 41.5, (2, 1): 80.25})
    path.write_text(to_toml(half))
    assert load(path).unknown == {(1, 3), (3, 1), (2, 3), (3, 2)}


def test_the_bulk_probe_times_what_the_receiver_got() -> None:
    async def main() -> None:
        server = await bulkprobe.serve_sink("127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            assert await bulkprobe.measure("127.0.0.1", port, 2_000_000) > 0
            with pytest.raises(bulkprobe.ProbeError, match="sends 2"):
                await bulkprobe.measure("127.0.0.1", port, 1)
        finally:
            server.close()
        with pytest.raises(bulkprobe.ProbeError, match="failed"):
            await bulkprobe.measure("127.0.0.1", port, 1000, timeout=5)

    asyncio.run(main())


def test_a_link_counts_its_fastest_probe_and_fails_only_when_none_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes: list[float | bulkprobe.ProbeError] = []

    async def scripted(host: str, port: int, nbytes: int, *, timeout: float = 60.0) -> float:  # noqa: ASYNC109
        outcome = outcomes.pop(0)
        if isinstance(outcome, bulkprobe.ProbeError):
            raise outcome
        return outcome

    monkeypatch.setattr(bulkprobe, "measure", scripted)

    def best(*script: float | bulkprobe.ProbeError) -> float:
        outcomes[:] = script
        rate = asyncio.run(bulkprobe.measure_best("10.0.0.2", 9750, 1000, tries=len(script)))
        assert not outcomes  # every try ran
        return rate

    assert best(30.0, 50.0) == 50.0 and best(50.0, 30.0) == 50.0
    assert best(bulkprobe.ProbeError("refused"), 40.0) == 40.0
    with pytest.raises(bulkprobe.ProbeError, match="second"):
        best(bulkprobe.ProbeError("first"), bulkprobe.ProbeError("second"))
    outcomes[:] = [1.0]
    with pytest.raises(bulkprobe.ProbeError, match="sends 2"):  # refused before any probe
        asyncio.run(bulkprobe.measure_best("10.0.0.2", 9750, 1))
    assert outcomes == [1.0]


def test_a_receiver_that_stalls_still_times_the_link_from_the_kernels_counts() -> None:
    """A 100 B/s link delivers 1000 bytes by t = 10. The receiver is off the CPU from 4 to 8 (over the
    half) and from 9 to 14 (over the end): each read's kernel count is a true point of the arrival curve,
    so the rate comes out exact (timing its reads from the nominal half to the last read gives 83 B/s)."""
    reads = [1.0, 2.0, 3.0, 4.0, 8.0, 9.0, 14.0]
    samples = [(t, min(1000, round(100 * t))) for t in reads]
    counted, seconds = bulkprobe.second_half(samples, 1000, kernel=True)
    assert (counted, seconds) == (500, 5.0)  # from (4, 400) to (9, 900)
    # the counts of what was read (no TCP_INFO): from the first read past half to the last, its own counts
    assert bulkprobe.second_half(samples, 1000, kernel=False) == (200, 6.0)
    # a stall over the whole second half leaves the last read as the window's end
    assert bulkprobe.second_half([(1.0, 100), (5.0, 500), (12.0, 1000)], 1000, kernel=True) == (500, 7.0)


@pytest.mark.root
@pytest.mark.slow
def test_probing_an_emulated_wan_without_rates_recovers_the_applied_ones(tmp_path: Path) -> None:
    truth = tmp_path / "truth.toml"
    truth.write_text('name = "tri"\n[defaults]\nlatency_ms = 10.0\n[[node]]\nid = 1\n[[node]]\nid = 2\n[[node]]\n'
                     'id = 3\n[[link]]\na = 1\nb = 2\nrate_mbit = [40, 80]\n[[link]]\na = 2\nb = 3\nrate_mbit = 60\n'
                     '[[link]]\na = 1\nb = 3\nrate_mbit = 30\n')
    bare = tmp_path / "bare.toml"
    bare.write_text('name = "tri"\n[[node]]\nid = 1\n[[node]]\nid = 2\n[[node]]\nid = 3\n')
    out = tmp_path / "measured.toml"
    done = subprocess.run([sys.executable, "-m", "netstorm.cli", "probe", str(bare), "--emulate", "--applied",
                           str(truth), "--bytes", "2000000", "--out", str(out), "--json", "--tolerance", "0.5"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(done.stdout)["links"]
    assert len(rows) == 6
    assert_measures([r["ratio"] for r in rows])
    measured = load(out)
    assert not measured.unknown
    applied = load(truth).rates()
    assert_measures([rate / applied[link] for link, rate in measured.rates().items()])


@pytest.mark.root
@pytest.mark.slow
def test_an_emulated_job_told_no_rates_plans_its_first_policy_from_what_its_scheduler_probed(tmp_path: Path) -> None:
    """The scheduler is given links without rates (and one with): its nodes probe the four unrated
    directions from their namespaces, the result sets what it measured against the applied rates, and
    the first policy is planned from those measurements and the stated rate, not from the prior."""
    truth = tmp_path / "truth.toml"
    truth.write_text('name = "tri"\n[[node]]\nid = 1\n[[node]]\nid = 2\n[[node]]\nid = 3\n[[link]]\na = 1\nb = 2\n'
                     'rate_mbit = [40, 80]\n[[link]]\na = 2\nb = 3\nrate_mbit = 60\n[[link]]\na = 1\nb = 3\n'
                     'rate_mbit = 30\n')
    bare = tmp_path / "bare.toml"
    bare.write_text('name = "tri"\n[defaults]\nprior_mbit = 500\n[[node]]\nid = 1\n[[node]]\nid = 2\n[[node]]\nid = 3\n'
                    '[[link]]\na = 1\nb = 2\n[[link]]\na = 2\nb = 3\n[[link]]\na = 1\nb = 3\nrate_mbit = 30\n')
    out, run_dir = tmp_path / "result.json", tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "netstorm.cli", "emulate", str(truth), "--system", "netstorm",
                           "--iterations", "2", "--model", "200k", "--plan-scenario", str(bare), "--probe-bytes",
                           "2000000", "--run-dir", str(run_dir), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["probe"]["by"] == "scheduler" and result["probe"]["unrated_links"] == 4
    system = result["systems"]["netstorm"]
    assert system["iterations_completed"] == 2
    probe = system["probe"]
    rows = probe["links"]
    assert [(r["src"], r["dst"]) for r in rows] == [(1, 2), (2, 1), (2, 3), (3, 2)] and not probe["failed"]
    assert_measures([r["ratio"] for r in rows])
    assert probe["worst_relative_error"] == max(round(abs(r["ratio"] - 1), 4) for r in rows)
    assert system["policy_versions"]["policies"][0]["reason"] == "first plan, 4 link(s) probed"
    # the first policy names the rates it was planned from: the scheduler's measurements, not the prior
    logs = "".join(p.read_text(errors="replace") for p in run_dir.rglob("scheduler*.log"))
    line = next(ln for ln in logs.splitlines() if "policy version 0 (first plan" in ln)
    planned = {tuple(map(int, pair.split(":")[0].split(">"))): float(pair.split(":")[1])
               for pair in line.split("planned from Mbit/s ")[1].split()}
    assert planned[(1, 3)] == planned[(3, 1)] == 30.0
    for r in rows:
        assert planned[(r["src"], r["dst"])] == pytest.approx(r["measured_mbit"], abs=0.06), r
