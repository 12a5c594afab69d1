"""``netstorm emulate --trainer diloco``: DiLoCo systems and their DDP reference on one shaped WAN, and the
fold of the trainers' lines into a result (target loss, time to it, identity, limits, rejoin)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from netstorm.emulation import diloco_fold, diloco_systems
from netstorm.emulation.errors import EmulationError
from netstorm.trainers.launch import TRAINERS, TRAINS
from tests.conftest import require

DATA = Path(__file__).parent / "data"
FIELDS = ("eval", "time_to_target_s", "final_eval_loss", "compute_fraction", "sync_s", "sync_limit_s",
          "wan_bytes_per_step", "identical")


# ---- the fold, on plain data ------------------------------------------------------------------------

def _dc(dc: int, *, digests: list[str], end: str, evals: list[tuple[float, int, float]], began: float = 100.0,
        starts: int = 1, skip: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"kind": "start", "dc": dc, "fragment_bytes": 1_000_000, "parameters": 500_000}
                                 for _ in range(starts)]
    for i, d in enumerate(digests):
        if i not in skip:
            out.append({"kind": "sync", "index": i, "seconds": 0.5 + 0.1 * dc, "began": began + 10 * i,
                        "digest": d, "wan_bytes": 2_000_000})
    out += [{"kind": "eval", "t_s": t, "step": s, "loss": loss, "accuracy": 0.5} for t, s, loss in evals]
    out.append({"kind": "end", "steps": 40, "wall_s": 20.0, "compute_s": 10.0 + dc, "digest": end})
    return out


RATES: list[dict[str, Any]] = [{"t": 0.0, "epoch": 0, "rates_mbit": {
    "1->2": 80.0, "2->1": 80.0, "1->3": 40.0, "3->1": 40.0, "2->3": 80.0, "3->2": 80.0}}]
"""λ = 120 Mbit/s (either way out of DC 3): a 1 MB fragment's limit is 8 Mbit / 120 Mbit/s."""


def test_a_system_entry_has_every_field_and_its_limits_are_the_fragment_over_the_min_cut() -> None:
    evals = [(5.0, 10, 1.0), (10.0, 20, 0.5), (15.0, 30, 0.3)]
    per_dc = {dc: _dc(dc, digests=["a", "b", "c"], end="z", evals=evals) for dc in (1, 2, 3)}
    entry = diloco_fold.system_entry(per_dc, RATES, origin=90.0, steps=40, link_bytes=8_000_000)
    assert set(FIELDS) - {"time_to_target_s"} <= set(entry)
    assert entry["identical"] is True
    assert entry["sync_s"] == [0.8, 0.8, 0.8]  # the slowest DC's view of each sync
    assert entry["sync_limit_s"] == [pytest.approx(8 / 120, abs=1e-4)] * 3
    assert entry["compute_fraction"] == pytest.approx((11 + 12 + 13) / 60, abs=1e-4)
    assert entry["wan_bytes_per_step"] == 200_000
    assert entry["final_eval_loss"] == 0.3
    assert [e["step"] for e in entry["eval"]] == [10, 20, 30]


def test_the_limit_follows_the_rates_in_force_when_a_sync_began() -> None:
    slower = {"t": 15.0, "epoch": 1, "rates_mbit": {k: v / 2 for k, v in RATES[0]["rates_mbit"].items()}}
    per_dc = {dc: _dc(dc, digests=["a", "b", "c"], end="z", evals=[]) for dc in (1, 2)}
    limits = diloco_fold.sync_limits(per_dc, [*RATES, slower], origin=90.0)  # syncs begin at t = 10, 20, 30
    assert limits[0] == pytest.approx(8 / 120, abs=1e-4)   # done before the re-draw at 15
    assert limits[1] == limits[2] == pytest.approx(8 / 60, abs=1e-4)


def test_a_trainer_that_stamps_no_start_or_size_is_bounded_from_its_parameters_and_the_first_rates() -> None:
    per_dc = {dc: [{"kind": "start", "parameters": 500_000},
                   *({"kind": "sync", "index": i, "seconds": 1.0, "digest": "a"} for i in range(2))]
              for dc in (1, 2)}
    assert diloco_fold.fragment_bytes(per_dc, fragments=2) == 1_000_000
    assert diloco_fold.sync_limits(per_dc, RATES, origin=90.0, fragments=2) == [pytest.approx(8 / 120, abs=1e-4)] * 2


def test_identical_is_false_when_one_sync_or_the_ends_disagree_and_never_null() -> None:
    evals = [(5.0, 10, 1.0)]
    same = {1: _dc(1, digests=["a", "b"], end="z", evals=evals), 2: _dc(2, digests=["a", "b"], end="z", evals=evals)}
    assert diloco_fold.identical(same) is True
    split = {1: _dc(1, digests=["a", "b"], end="z", evals=evals), 2: _dc(2, digests=["a", "x"], end="z", evals=evals)}
    assert diloco_fold.identical(split) is False
    ends = {1: _dc(1, digests=["a", "b"], end="z", evals=evals), 2: _dc(2, digests=["a", "b"], end="y", evals=evals)}
    assert diloco_fold.identical(ends) is False
    assert diloco_fold.identical({1: [{"kind": "start", "fragment_bytes": 1}]}) is False


def test_target_loss_is_the_reference_final_loss_times_the_factor_and_each_system_times_its_first_crossing() -> None:
    result: dict[str, Any] = {"systems": {
        "netstorm-ddp": {"final_eval_loss": 0.2, "eval": [{"t_s": 4.0, "loss": 0.5}, {"t_s": 9.0, "loss": 0.2}]},
        "netstorm-streaming": {"final_eval_loss": 0.25, "eval": [{"t_s": 2.0, "loss": 0.4}, {"t_s": 3.0, "loss": 0.21},
                                                                 {"t_s": 5.0, "loss": 0.19}]},
        "netstorm-diloco": {"final_eval_loss": 0.3, "eval": [{"t_s": 2.0, "loss": 0.3}]},
    }}
    diloco_fold.with_targets(result)
    assert result["target_loss"] == pytest.approx(0.21)
    assert result["target_from"] == "netstorm-ddp" and "1.05" in result["target_rule"]
    assert result["systems"]["netstorm-ddp"]["time_to_target_s"] == 9.0
    assert result["systems"]["netstorm-streaming"]["time_to_target_s"] == 3.0   # 0.21 <= 0.21: reached
    assert result["systems"]["netstorm-diloco"]["time_to_target_s"] is None


def test_without_a_reference_there_is_no_target_and_gloo_ddp_stands_in_for_netstorm_ddp() -> None:
    alone: dict[str, Any] = {"systems": {"netstorm-streaming": {"final_eval_loss": 0.3,
                                                                "eval": [{"t_s": 1, "loss": 0.3}]}}}
    assert diloco_fold.with_targets(alone)["target_loss"] is None
    assert alone["systems"]["netstorm-streaming"]["time_to_target_s"] is None
    gloo: dict[str, Any] = {"systems": {"gloo-ddp": {"final_eval_loss": 1.0, "eval": []}}}
    assert diloco_fold.with_targets(gloo)["target_loss"] == pytest.approx(1.05)


def test_rejoined_counts_the_syncs_from_the_restart_until_the_dc_agrees_and_restarts_only_unexplained_starts() -> None:
    evals = [(5.0, 10, 1.0)]
    per_dc = {1: _dc(1, digests=["a", "b", "c", "d"], end="z", evals=evals),
              2: _dc(2, digests=["a", "b", "c", "d"], end="z", evals=evals),
              3: _dc(3, digests=["a", "b", "x", "d"], end="z", evals=evals, starts=2, skip=(1,))}
    # DC 3 restarted at t=105: syncs 1 (t=110, it missed), 2 (t=120, it disagreed), 3 (t=130, agreed)
    assert diloco_fold.rejoined(per_dc, [(3, 105.0)]) == {"3": 3}
    assert diloco_fold.job_restarts(per_dc, {3: 1}) == 0
    assert diloco_fold.job_restarts(per_dc, {}) == 1


# ---- the CLI and the system table -------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    from netstorm.commands import emulate

    parser = argparse.ArgumentParser()
    emulate.add_arguments(parser)
    return parser


def test_the_cli_trainer_and_train_choices_follow_the_registry() -> None:
    actions = {a.dest: a for a in _parser()._actions}
    assert actions["trainer"].choices is not None and actions["train"].choices is not None
    assert "diloco" in TRAINERS and list(actions["trainer"].choices) == list(TRAINERS)
    assert set(actions["train"].choices) == {t for names in TRAINS.values() for t in names}
    assert set(TRAINS["diloco"]) == {"digits", "pylm"}


def test_the_system_table_runs_each_trainer_on_its_runtime_with_its_schedule() -> None:
    from netstorm.emulation.runner import options_from_args

    args = _parser().parse_args([str(DATA / "emu-3.toml"), "--trainer", "diloco", "--train", "digits",
                                 "--sync-every", "20", "--fragments", "2", "--fragment-delay", "5",
                                 "--outer-compression", "int8", "--compute-s", "0.5", "--steps", "80",
                                 "--system", "all"])
    opts = options_from_args(args)
    assert [s.name for s in opts.diloco.systems] == list(diloco_systems.SYSTEMS)
    where = diloco_systems.Where(socket="/run/node-1.sock", rendezvous="10.0.0.1:29500", address="10.1.0.1")
    argvs = {s.name: diloco_systems.trainer_argv(s, opts, dc=1, rank=0, world=3, out=Path("o"), where=where)
             for s in opts.diloco.systems}

    def flag(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    assert flag(argvs["netstorm-diloco"], "-m") == "netstorm.trainers.diloco_run"
    assert (flag(argvs["netstorm-diloco"], "--fragments"), flag(argvs["netstorm-diloco"], "--fragment-delay"),
            flag(argvs["netstorm-diloco"], "--outer-compression")) == ("1", "0", "none")
    assert (flag(argvs["netstorm-streaming"], "--fragments"), flag(argvs["netstorm-streaming"], "--fragment-delay"),
            flag(argvs["netstorm-streaming"], "--outer-compression")) == ("2", "5", "int8")
    assert flag(argvs["torchft-streaming"], "-m") == diloco_systems.TORCHFT_MODULE
    assert "--socket" not in argvs["torchft-streaming"] and "--lighthouse" in argvs["torchft-streaming"]
    assert flag(argvs["torchft-streaming"], "--hostname") == "10.1.0.1"
    assert flag(argvs["netstorm-ddp"], "--backend") == "netstorm" and flag(argvs["gloo-ddp"], "--backend") == "gloo"
    for name in ("netstorm-ddp", "gloo-ddp"):
        assert flag(argvs[name], "--task") == "digits" and flag(argvs[name], "--compute-s") == "0.5"
    for argv in argvs.values():
        assert "0.5" in argv and "80" in argv


def test_a_system_whose_trainer_module_is_missing_fails_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == diloco_systems.TORCHFT_MODULE else real(name, *a))
    with pytest.raises(EmulationError, match=diloco_systems.TORCHFT_MODULE.replace(".", r"\.")):
        diloco_systems.SYSTEMS["torchft-streaming"].check()
    diloco_systems.SYSTEMS["netstorm-streaming"].check()


def test_chaos_runs_only_with_systems_that_rejoin() -> None:
    from netstorm.emulation.runner import options_from_args

    args = _parser().parse_args([str(DATA / "emu-3.toml"), "--trainer", "diloco", "--sync-every", "10",
                                 "--steps", "20", "--system", "netstorm-streaming,netstorm-ddp",
                                 "--chaos", "kill-dc:3@5s,restart-dc:3@9s"])
    with pytest.raises(EmulationError, match="netstorm-ddp cannot rejoin"):
        options_from_args(args)


# ---- on the emulated WAN ----------------------------------------------------------------------------

@pytest.mark.root
@pytest.mark.slow
@pytest.mark.torch
def test_streaming_diloco_and_its_ddp_reference_on_a_shaped_three_dc_wan(tmp_path: Path) -> None:
    require(importlib.util.find_spec("sklearn") is not None, "needs scikit-learn (the digits data)")
    out = tmp_path / "diloco.json"
    proc = subprocess.run([sys.executable, "-m", "netstorm.cli", "emulate", str(DATA / "emu-3.toml"),
                           "--trainer", "diloco", "--train", "digits", "--sync-every", "10", "--fragments", "2",
                           "--fragment-delay", "2", "--compute-s", "0.05", "--steps", "20",
                           "--system", "netstorm-streaming,netstorm-ddp", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["target_from"] == "netstorm-ddp" and result["compute_s"] == 0.05
    assert result["target_loss"] == pytest.approx(
        diloco_fold.TARGET_FACTOR * result["systems"]["netstorm-ddp"]["final_eval_loss"], rel=1e-4)
    for name in ("netstorm-streaming", "netstorm-ddp"):
        entry = result["systems"][name]
        assert set(FIELDS) <= set(entry), name
        assert entry["identical"] is True, name
        assert entry["eval"] and all(set(e) == {"t_s", "step", "loss", "accuracy"} for e in entry["eval"])
        assert entry["sync_s"] and len(entry["sync_s"]) == len(entry["sync_limit_s"])
        for seconds, limit in zip(entry["sync_s"], entry["sync_limit_s"], strict=True):
            assert limit > 0 and seconds >= 0.5 * limit, (name, seconds, limit)
        assert 0.0 < entry["compute_fraction"] <= 1.0
        assert entry["wan_bytes_per_step"] > 0
    assert len(result["systems"]["netstorm-ddp"]["sync_s"]) == 20       # one all-reduce per step
    streaming = result["systems"]["netstorm-streaming"]
    assert streaming["schedule"] == {"fragments": 2, "fragment_delay": 2, "outer_compression": "none"}
    assert streaming["fragment_bytes"] < result["systems"]["netstorm-ddp"]["fragment_bytes"]
